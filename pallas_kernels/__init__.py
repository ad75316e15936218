"""Multi-prefix masked attention behind one call, whatever the implementation.

`attention(..., impl=...)` is what the model calls; the engine never sees which implementation runs.

- "xla": the plain-jnp reference (`reference.py`), a dense [T, S] mask built from the metadata.
- "pallas": the Pallas kernel for this backend: TPU -> the Mosaic kernel (`tpu.py`), GPU -> the Triton kernel
  (`gpu.py`); on CPU the GPU-style kernel runs in interpret mode (slow; for tests).
- "auto": "pallas" on GPU and TPU, "xla" on CPU.
- "pallas_tpu" / "pallas_gpu": that kernel whatever the backend (interpreted off its own hardware).

Both kernels build the mask inside the kernel from the O(T) metadata and skip empty (query block, key block)
tiles using `block_map.key_block_ranges`.
"""

from __future__ import annotations

import jax

from pallas_kernels.reference import attention_reference, visibility

IMPLS = ("xla", "pallas", "auto", "pallas_gpu", "pallas_tpu")


def resolve(impl: str, backend: str | None = None, interpret: bool | None = None) -> tuple[str, bool]:
    """(implementation, interpret) that `impl` means on `backend` (default: jax's default backend).

    The implementation is one of "xla", "pallas_gpu", "pallas_tpu". `interpret=None` interprets a kernel
    exactly when the backend is not its hardware; True forces the interpreter (tests on any machine).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; available: {', '.join(IMPLS)}")
    backend = backend or jax.default_backend()
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
    if kind == "pallas_tpu":
        from pallas_kernels.tpu import attention_tpu
        return attention_tpu(q, k, v, lengths, limit, group, scale=scale, interpret=interp)
    from pallas_kernels.gpu import attention_gpu
    return attention_gpu(q, k, v, lengths, limit, group, scale=scale, interpret=interp)


__all__ = ["IMPLS", "attention", "attention_reference", "resolve", "visibility"]
