"""Both kernels lower for their hardware from this CPU machine (Triton IR for CUDA, Mosaic IR for TPU).

Interpret mode accepts code a compiler rejects (unsupported ops, block shapes, scalar loads); lowering catches
much of that without the hardware. It is not a compile: Triton and Mosaic still run their own passes on device.
The poisoned variant is the one the compiled tests call.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib  # the abstract TPU device the Mosaic lowering asks for

from pallas_kernels.gpu import attention_gpu
from pallas_kernels.tpu import attention_tpu

CASES = [(64, jnp.float32, False), (128, jnp.bfloat16, True)]


def _args(t, s, d, dtype):
    q = jax.ShapeDtypeStruct((2, t, 8, d), dtype)
    kv = jax.ShapeDtypeStruct((2, s, 2, d), dtype)
    lengths, meta = jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, t), jnp.int32)
    return q, kv, kv, lengths, meta, meta


@pytest.mark.parametrize("d,dtype,poisoned", CASES)
def test_gpu_kernel_lowers_to_triton(d, dtype, poisoned):
    fn = functools.partial(attention_gpu, block_q=64, block_k=64)
    poison = jax.ShapeDtypeStruct((2, 320, 8, d), dtype) if poisoned else None
    traced = jax.jit(fn).trace(*_args(300, 700, d, dtype), poison=poison)
    assert "multi_prefix_attention_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d,dtype,poisoned", CASES)
def test_tpu_kernel_lowers_to_mosaic(d, dtype, poisoned):
    device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    poison = jax.ShapeDtypeStruct((2, 384, 8, d), dtype) if poisoned else None
    with jax.sharding.use_abstract_mesh(mesh_lib.AbstractMesh((1,), ("x",), abstract_device=device)):
        traced = jax.jit(attention_tpu).trace(*_args(300, 700, d, dtype), poison=poison)
        lowered = traced.lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
