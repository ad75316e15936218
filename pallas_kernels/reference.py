"""Plain-jnp multi-prefix masked attention: the XLA path and the reference every kernel is tested against.

Keys live in a cache buffer of S slots per row. Slots below `lengths[b]` are the row's context; the new
block of T tokens was written at slots `lengths[b] + j`. Query i of the block sees every context slot and
block token j when `(group[j] == 0 and j < limit[i]) or (group[j] == group[i] != 0 and j <= i)` (DESIGN §2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visibility(lengths: jax.Array, limit: jax.Array, group: jax.Array, num_slots: int) -> jax.Array:
    """Boolean [B, T, S]: may query i of row b attend to cache slot s. Dense: for the XLA path only."""
    t = limit.shape[1]
    slot = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]
    ctx = lengths.astype(jnp.int32)[:, None, None]
    j = slot - ctx
    if t == 1:  # one-token decode: the same rule without the gather (the hot loop of every generation)
        sees_itself = ((limit > 0) | (group != 0))[:, :, None]
        return (slot < ctx) | ((j == 0) & sees_itself)
    in_block = (j >= 0) & (j < t)
    key_group = jnp.take_along_axis(group[:, None, :], jnp.clip(j, 0, t - 1), axis=2)
    query_group = group[:, :, None]
    i = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    shared = (key_group == 0) & (j < limit[:, :, None])
    own = (key_group == query_group) & (query_group != 0) & (j <= i)
    return (slot < ctx) | (in_block & (shared | own))


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
