"""Which key blocks each query block must visit, derived from the O(T) metadata (splash attention's block map).

A kernel tiles queries into blocks of `block_q` rows and the cache into blocks of `block_k` slots. From
`lengths`, `limit` and `group` alone (never a T x S mask) this module finds, per (row, query block), the
key blocks that hold at least one visible key, as two intervals of key blocks:

    [0, a_end)        the context and the shared draft: every key slot < lengths + max(limit) of the block
    [b_start, b_end)  the queries' own groups: from the first token of the earliest group to the last query

and `full_end <= a_end`: key blocks below it are visible to every query of the block (context, and draft
tokens below the smallest `limit`), so a kernel may skip the mask there. Tiles outside both intervals are
empty: no compute, and on TPU no DMA either. The bounds hold for any metadata (groups need not be
contiguous); the packed layout of docs/design.md §2 (contiguous groups) makes them tight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_RANGES = 4  # full_end, a_end, b_start, b_end


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def first_of_group(group: jax.Array) -> jax.Array:
    """[B, T] -> [B, T]: index of the first token with the same group as token i (a stable sort, O(T log T))."""
    b, t = group.shape
    order = jnp.argsort(group, axis=1, stable=True)
    sorted_group = jnp.take_along_axis(group, order, axis=1)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    starts = jnp.concatenate([jnp.ones((b, 1), bool), sorted_group[:, 1:] != sorted_group[:, :-1]], axis=1)
    run_start = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
    first_sorted = jnp.take_along_axis(order, run_start, axis=1).astype(jnp.int32)
    inverse = jnp.argsort(order, axis=1)
    return jnp.take_along_axis(first_sorted, inverse, axis=1)


def key_block_ranges(lengths: jax.Array, limit: jax.Array, group: jax.Array, num_slots: int, block_q: int,
                     block_k: int) -> jax.Array:
    """int32 [B, ceil(T / block_q), 4]: (full_end, a_end, b_start, b_end) in key-block units, per query block.

    Slots at or past `num_slots` (the real cache length, before any padding) are never visited.
    """
    b, t = limit.shape
    t_pad = round_up(t, block_q)
    nq = t_pad // block_q
    num_k_blocks = -(-num_slots // block_k)
    big = jnp.iinfo(jnp.int32).max
    ctx = lengths.astype(jnp.int32)[:, None]
    limit = jnp.clip(limit.astype(jnp.int32), 0, t)
    group = group.astype(jnp.int32)
    i = jnp.arange(t, dtype=jnp.int32)[None, :]
    own = group != 0
    # Keys [0, ctx + limit) hold everything the shared rule can show; [ctx + first, ctx + i] the own rule.
    shared_end = ctx + limit
    own_start = jnp.where(own, ctx + first_of_group(group), big)
    own_end = jnp.where(own, ctx + i + 1, 0)
    # Keys below ctx + min(limit, first non-draft token) are visible to the query whatever its group.
    first_other = jnp.min(jnp.where(own, i, t), axis=1, keepdims=True)
    full = ctx + jnp.minimum(limit, first_other)

    def per_block(x, pad, reduce):
        x = jnp.pad(x, ((0, 0), (0, t_pad - t)), constant_values=pad)
        return reduce(x.reshape(b, nq, block_q), axis=2)

    slots = jnp.int32(num_slots)
    a_end_slot = jnp.minimum(per_block(shared_end, 0, jnp.max), slots)
    full_slot = jnp.minimum(per_block(full, big, jnp.min), slots)
    own_lo = per_block(own_start, big, jnp.min)
    own_hi = jnp.minimum(per_block(own_end, 0, jnp.max), slots)

    a_end = -(-a_end_slot // block_k)
    full_end = jnp.minimum(full_slot // block_k, a_end)
    has_own = own_hi > jnp.minimum(own_lo, slots)
    b_start = jnp.where(has_own, jnp.maximum(jnp.minimum(own_lo, slots) // block_k, a_end), a_end)
    b_end = jnp.where(has_own, jnp.maximum(-(-own_hi // block_k), b_start), b_start)
    out = jnp.stack([full_end, a_end, b_start, b_end], axis=-1)
    return jnp.clip(out, 0, num_k_blocks).astype(jnp.int32)


def visited_block(ranges: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The key block a kernel handles at `step` of one query block, and whether that step does any work.

    Past the last visited block the index stays on that block, so a pipelined kernel issues no new copy.
    """
    a_end, b_start, b_end = ranges[1], ranges[2], ranges[3]
    count = a_end + b_end - b_start
    at = jnp.minimum(step, jnp.maximum(count - 1, 0))
    block = jnp.where(at < a_end, at, b_start + at - a_end)
    return block, step < count


def key_groups_by_slot(lengths: jax.Array, group: jax.Array, num_slots: int) -> jax.Array:
    """int32 [B, num_slots]: the group of the block token stored in each slot (slot-aligned, so a kernel reads
    it with the key block it belongs to). Only slots in [lengths, lengths + T) are meaningful."""
    t = group.shape[1]
    j = jnp.arange(num_slots, dtype=jnp.int32)[None, :] - lengths.astype(jnp.int32)[:, None]
    return jnp.take_along_axis(group.astype(jnp.int32), jnp.clip(j, 0, t - 1), axis=1)


def tile_counts(ranges: jax.Array, num_k_blocks: int) -> tuple[jax.Array, int]:
    """(visited tiles, all tiles) per row and head: how much of the dense work a kernel does."""
    visited = ranges[..., 1] + ranges[..., 3] - ranges[..., 2]
    return jnp.sum(visited), ranges.shape[0] * ranges.shape[1] * num_k_blocks
