"""EAGLE-3 trees: sibling leaves beside the drafted chain, chosen by draft confidence, verified in the same target
pass (one prefix group per leaf, docs/design.md §2), an accepted leaf's KV moved into the path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parse_jax.models.cache import KVCache


def tree_leaves(props: jax.Array, head_logits: jax.Array, num_leaves: int) -> tuple[jax.Array, jax.Array]:
    """EAGLE-2's dynamic expansion, restricted to siblings of the chain: a node replacing proposal i by token c has
    confidence prod_{j<i} p_j(props_j) * p_i(c) under the head; the `num_leaves` most confident become leaves.
    Returns (depth [B, M] = i, token [B, M])."""
    b, gamma, v = head_logits.shape
    p = jax.nn.softmax(head_logits.astype(jnp.float32), axis=-1)
    p_chain = jnp.take_along_axis(p, props[..., None], -1)[..., 0]
    prefix = jnp.cumprod(jnp.concatenate([jnp.ones((b, 1)), p_chain[:, :-1]], axis=1), axis=1)
    conf = prefix[..., None] * p
    conf = jnp.where(jax.nn.one_hot(props, v, dtype=bool), -1.0, conf)  # the chain's own tokens are not leaves
    _, flat = jax.lax.top_k(conf.reshape(b, gamma * v), num_leaves)
    return (flat // v).astype(jnp.int32), (flat % v).astype(jnp.int32)


def tree_block(trunk: jax.Array, leaf_depth: jax.Array, leaf_tok: jax.Array, start: jax.Array):
    """The tree as a set of prefixes (docs/design.md §2): the chain [last, d_1..d_gamma] is group 0 (causal), leaf
    m (replacing d_{i+1}) is group m + 1, sees the chain up to d_i and sits at RoPE position start + i + 1."""
    b, g1 = trunk.shape
    m = leaf_tok.shape[1]
    block = jnp.concatenate([trunk, leaf_tok], axis=1)
    chain_pos = jnp.arange(g1, dtype=jnp.int32)[None]
    pos = start + jnp.concatenate([jnp.broadcast_to(chain_pos, (b, g1)), leaf_depth + 1], axis=1)
    limit = jnp.concatenate([jnp.broadcast_to(chain_pos + 1, (b, g1)), leaf_depth + 1], axis=1)
    group = jnp.concatenate([jnp.zeros((b, g1), jnp.int32),
                             jnp.broadcast_to(jnp.arange(1, m + 1, dtype=jnp.int32)[None], (b, m))], axis=1)
    return block, pos, limit, group


def move_kv(cache: KVCache, src: jax.Array, dst: jax.Array, where: jax.Array) -> KVCache:
    """Copy each row's KV entry at slot `src` to slot `dst` where `where` (an accepted leaf takes the place of the
    rejected chain token); the entry was computed at the right RoPE position, so nothing is recomputed."""
    rows = jnp.arange(cache.batch)
    src = jnp.clip(src, 0, cache.max_len - 1)
    dst = jnp.where(where, jnp.clip(dst, 0, cache.max_len - 1), cache.max_len)  # out of range: dropped

    def move(buf):
        return buf.at[rows, :, dst].set(buf[rows, :, src], mode="drop")

    return cache.replace(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))
