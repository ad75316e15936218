"""Both Pallas kernels against the reference on random layouts, with NaN-poisoned output buffers.

Interpret mode runs everywhere (TPU kernel: the TPU interpreter; GPU kernel: `interpret=True`). The compiled
classes run the same checks on a GPU or TPU and skip, saying why, on other backends. Each shape compiles once;
hypothesis draws the layout (cache length, draft length, K, suffix length, padding, blind rows) and the data.

Poisoning: the output buffer passed in (`poison`, aliased to the output) is all NaN. The GPU interpreter keeps
whatever a kernel does not write, so a skipped element stays NaN. The TPU interpreter writes whole VMEM output
blocks back, which start as NaN (its `uninitialized_memory="nan"`) and are then reused: an unwritten block
shows up as NaN or as another block's values, and the comparison with the reference catches both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import attention_reference, visibility
from pallas_kernels.block_map import round_up
from pallas_kernels.gpu import attention_gpu, gpu_block_q
from pallas_kernels.tpu import attention_tpu
from tests.pallas_kernels.layouts import metadata

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
_reference = jax.jit(attention_reference)
_blind = jax.jit(lambda lengths, limit, group, s: ~visibility(lengths, limit, group, s).any(axis=-1),
                 static_argnums=3)


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    tokens: int   # T: not a multiple of the query block
    slots: int    # S: not a multiple of the key block
    heads: int
    kv_heads: int
    head_dim: int
    dtype: type
    block_q: int
    block_k: int

    def __str__(self):
        return (f"B{self.batch}-T{self.tokens}-S{self.slots}-H{self.heads}/{self.kv_heads}-D{self.head_dim}-"
                f"{jnp.dtype(self.dtype).name}-blocks{self.block_q}x{self.block_k}")


GPU_SHAPES = [
    Shape(2, 45, 100, 4, 2, 64, jnp.float32, 16, 16),
    Shape(1, 70, 200, 4, 1, 128, jnp.bfloat16, 64, 64),  # the default blocks
    Shape(2, 1, 20, 2, 2, 64, jnp.float32, 64, 64),      # one-token decode
]
TPU_SHAPES = [  # the interpreter costs ~50 ms a grid step: few heads, few blocks
    Shape(2, 45, 150, 1, 1, 64, jnp.float32, 16, 128),
    Shape(1, 70, 200, 2, 1, 128, jnp.bfloat16, 32, 128),
]


def _run(kernel, shape: Shape, meta, seed: int, interpret: bool, block_q: int, block_k: int):
    lengths, limit, group = (jnp.asarray(x) for x in meta)
    rng = np.random.default_rng(seed)
    b, t, s, h, kv, d = shape.batch, shape.tokens, shape.slots, shape.heads, shape.kv_heads, shape.head_dim
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), shape.dtype)
    k = jnp.asarray(rng.normal(size=(b, kv, s, d)), shape.dtype)   # every slot holds data, visible or not
    v = jnp.asarray(rng.normal(size=(b, kv, s, d)), shape.dtype)
    if kernel == "gpu":
        t_pad = round_up(t, gpu_block_q(t, block_q))
        poison = jnp.full((b, t_pad, h, d), jnp.nan, shape.dtype)
        out = attention_gpu(q, k, v, lengths, limit, group, block_q=block_q, block_k=block_k, interpret=interpret,
                            poison=poison)
    else:
        poison = jnp.full((b, round_up(t, block_q), h, d), jnp.nan, shape.dtype)
        out = attention_tpu(q, k, v, lengths, limit, group, block_q=block_q, block_k=block_k, interpret=interpret,
                            poison=poison)
    ref = _reference(q, k, v, lengths, limit, group)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "NaN left in the output: an element was not written, or a row divided by 0"
    np.testing.assert_allclose(out, ref, rtol=0, atol=TOLERANCE[shape.dtype])
    blind = np.asarray(_blind(lengths, limit, group, s))  # [B, T]: rows that see nothing
    assert (out[blind] == 0).all()
    return blind.any()


def _check(kernel: str, shape: Shape, interpret: bool, max_examples: int, block_q=None, block_k=None):
    block_q, block_k = block_q or shape.block_q, block_k or shape.block_k

    @settings(max_examples=max_examples, deadline=None)
    @given(st.booleans().flatmap(lambda arb: metadata(shape.batch, shape.tokens, shape.slots, arb)),
           st.integers(0, 2**31 - 1))
    def check(meta, seed):
        _run(kernel, shape, meta, seed, interpret, block_q, block_k)

    check()


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_kernel_interpreted(shape):
    _check("gpu", shape, interpret=True, max_examples=10)


@pytest.mark.parametrize("shape", TPU_SHAPES, ids=str)
def test_tpu_kernel_interpreted(shape):
    _check("tpu", shape, interpret=True, max_examples=4)


@pytest.mark.parametrize("kernel,shape", [("gpu", GPU_SHAPES[0]), ("tpu", TPU_SHAPES[0])], ids=str)
def test_rows_with_no_visible_key_give_zeros(kernel, shape):
    """Draft rows with limit 0 over an empty context: no key at all, zeros, never NaN. In row 0 every third
    query is blind; in row 1 all are (whole query blocks with no tile to visit)."""
    lengths = np.zeros(shape.batch, np.int32)
    limit = np.tile(np.arange(1, shape.tokens + 1, dtype=np.int32), (shape.batch, 1))
    limit[0, ::3] = 0
    limit[1:] = 0
    group = np.zeros((shape.batch, shape.tokens), np.int32)
    assert _run(kernel, shape, (lengths, limit, group), 7, True, shape.block_q, shape.block_k)


ON_GPU = jax.default_backend() == "gpu"
ON_TPU = jax.default_backend() == "tpu"


@pytest.mark.skipif(not ON_GPU, reason=f"the compiled GPU kernel needs a CUDA GPU; jax backend is "
                                       f"{jax.default_backend()!r} (the interpreted tests cover the logic)")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_kernel_compiled(shape):
    _check("gpu", shape, interpret=False, max_examples=20)


@pytest.mark.skipif(not ON_TPU, reason=f"the compiled TPU kernel needs a TPU; jax backend is "
                                       f"{jax.default_backend()!r} (the interpreted tests cover the logic)")
@pytest.mark.parametrize("shape", TPU_SHAPES, ids=str)
def test_tpu_kernel_compiled(shape):
    _check("tpu", shape, interpret=False, max_examples=20, block_q=128, block_k=128)
