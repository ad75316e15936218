"""Multi-prefix masked attention behind one call, whatever the implementation.

`attention(..., impl=...)` is what the model calls; the engine never sees which implementation runs.

- "xla": the plain-jnp reference (`reference.py`), a dense [T, S] mask built from the metadata.
- "pallas": the Pallas kernel for the target platform: TPU -> the Mosaic kernel (`tpu.py`), GPU -> the Triton kernel
  (`gpu.py`); on CPU the GPU-style kernel runs in interpret mode (slow; for tests).
- "auto": "pallas" on GPU and TPU, "xla" on CPU.
- "pallas_tpu" / "pallas_gpu": that kernel whatever the backend (interpreted off its own hardware).

Both kernels build the mask inside the kernel from the O(T) metadata and skip empty (query block, key block)
tiles using `block_map.key_block_ranges`.

The target platform is jax's default backend, or the device of the abstract mesh programs are traced under
(`jax.sharding.use_abstract_mesh`, how `parse_jax.lowering` lowers for a TPU or a GPU from a CPU machine); compiled
kernels take their tiles from that chip and the head size (`tiles.py`), and run under `shard_map` on a mesh of
more than one device (`partition.py`: XLA cannot partition a custom call).
"""

from __future__ import annotations

import jax

from pallas_kernels.partition import needs_partition, partitioned
from pallas_kernels.reference import attention_reference, visibility
from pallas_kernels.tiles import TileError, target_platform, tiles_for

IMPLS = ("xla", "pallas", "auto", "pallas_gpu", "pallas_tpu")


def resolve(impl: str, backend: str | None = None, interpret: bool | None = None) -> tuple[str, bool]:
    """(implementation, interpret) that `impl` means on `backend` (default: the target platform, see the module doc).

    The implementation is one of "xla", "pallas_gpu", "pallas_tpu". `interpret=None` interprets a kernel
    exactly when the backend is not its hardware; True forces the interpreter (tests on any machine).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; available: {', '.join(IMPLS)}")
    backend = backend or target_platform()
    if impl == "auto":
        impl = "pallas" if backend in ("gpu", "tpu") else "xla"
    if impl == "xla":
        return "xla", False
    if impl == "pallas":
        impl = "pallas_tpu" if backend == "tpu" else "pallas_gpu"
    native = "tpu" if impl == "pallas_tpu" else "gpu"
    if interpret is None:
        interpret = backend != native
    if not interpret and backend != native:
        raise ValueError(f"attention_impl {impl!r} cannot be compiled on a {backend!r} backend; "
                         "use interpret=True or another attention_impl")
    return impl, bool(interpret)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, limit: jax.Array, group: jax.Array,
              impl: str = "xla", interpret: bool | None = None, scale: float | None = None) -> jax.Array:
    """q [B, T, H, D] over the cache k, v [B, KV, S, D] (block already written) -> [B, T, H, D] in q's dtype.

    Visibility follows docs/design.md §2 from `lengths` [B], `limit` [B, T], `group` [B, T]; see `reference.py`.
    """
    kind, interp = resolve(impl, interpret=interpret)
    if kind == "xla":
        return attention_reference(q, k, v, lengths, limit, group, scale)
    tiles = {}
    if not interp:  # compiled: tiles for the target chip (the interpreters keep the kernels' defaults)
        t = tiles_for(kind, q.shape[1], k.shape[2], q.shape[-1], q.dtype)
        tiles = {"block_q": t.block_q, "block_k": t.block_k}
        if kind == "pallas_gpu":
            tiles.update(num_warps=t.num_warps, num_stages=t.num_stages)
    if kind == "pallas_tpu":
        from pallas_kernels.tpu import attention_tpu as kernel
    else:
        from pallas_kernels.gpu import attention_gpu as kernel

    def run(q, k, v, lengths, limit, group):
        return kernel(q, k, v, lengths, limit, group, scale=scale, interpret=interp, **tiles)

    if needs_partition():  # XLA cannot partition a custom call: one kernel per device's shard (interpreted too, so
        # that a CPU mesh runs the path a TPU or GPU mesh runs)
        return partitioned(run, q, k, v, lengths, limit, group, check_vma=not interp)
    return run(q, k, v, lengths, limit, group)


__all__ = ["IMPLS", "TileError", "attention", "attention_reference", "resolve", "target_platform", "visibility"]
