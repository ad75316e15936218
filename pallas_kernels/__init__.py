"""Multi-prefix masked attention behind one call, whatever the implementation.

`attention(..., impl=...)` is what the model calls. Today only the XLA reference path exists; the
Pallas GPU/TPU kernels (issue 5) plug in here without the model or the engine changing.
"""

from __future__ import annotations

import jax

from pallas_kernels.reference import attention_reference, visibility

IMPLS = ("xla",)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, limit: jax.Array, group: jax.Array,
              impl: str = "xla") -> jax.Array:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; available: {', '.join(IMPLS)}")
    return attention_reference(q, k, v, lengths, limit, group)


__all__ = ["IMPLS", "attention", "attention_reference", "visibility"]
