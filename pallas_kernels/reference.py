"""Plain-jnp multi-prefix masked attention: the XLA path and the reference every kernel is tested against.

Keys live in a cache buffer of S slots per row. Slots below `lengths[b]` are the row's context; the new
block of T tokens was written at slots `lengths[b] + j`. Query i of the block sees every context slot and
block token j when `(group[j] == 0 and j < limit[i]) or (group[j] == group[i] != 0 and j <= i)` (docs/design.md §2),
written once in `mask.visible`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_map import key_groups_by_slot
from pallas_kernels.mask import visible


def visibility(lengths: jax.Array, limit: jax.Array, group: jax.Array, num_slots: int) -> jax.Array:
    """Boolean [B, T, S]: may query i of row b attend to cache slot s. Dense: for the XLA path only."""
    t = limit.shape[1]
    slot = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]
    ctx = lengths.astype(jnp.int32)[:, None, None]
    query_group = group[:, :, None]
    if t == 1:  # one-token decode: the only block token is the query itself, so no gather (the hot loop)
        key_group = query_group
    else:
        key_group = key_groups_by_slot(lengths, group, num_slots)[:, None, :]
    i = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    return visible(slot, ctx, key_group, query_group, i, limit[:, :, None], t)


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, limit: jax.Array,
                        group: jax.Array, scale: float | None = None) -> jax.Array:
    """q [B, T, H, D]; k, v [B, KV, S, D] (block already written); returns [B, T, H, D] in q's dtype.

    Softmax in float32. A query with no visible key gets zeros, never NaN.
    """
    b, t, h, d = q.shape
    out_dtype = q.dtype
    kv_heads = k.shape[1]
    groups = h // kv_heads
    scale = d ** -0.5 if scale is None else scale
    if q.dtype != jnp.float32 and jax.default_backend() == "cpu":
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))  # XLA:CPU has no bf16 x bf16 -> f32 dot
    qg = q.reshape(b, t, kv_heads, groups, d)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = visibility(lengths, limit, group, k.shape[2])[:, None, None, :, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bksd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(out_dtype)
