"""The packed verification block of docs/design.md §2 built on the device by index arithmetic, for a padded batch,
inside a jitted program: every verification pass (the modes' rounds, `scoring.score_prefixes`, the sharded scorer)
packs with it. Its numpy reference is tests/verify/layout_reference.py (`pack`, `verify_arrays`).

Row b's block is `seq[:seq_len]` (the tokens whose prefixes are judged: a prompt and its draft, or the target's
last token and a draft) followed by one copy of the suffix per boundary `bounds[b, :count]`, padded to `length`.
Draft token t: position ctx + t, sees the context and draft tokens <= t. Copy k token j: position
ctx + b_k + j, sees the context, draft tokens < b_k and copy-k tokens <= j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

PAD_GROUP = -1  # packed padding: no query may see it (group 0 is the draft, k >= 1 the copies)
PAD_ID = 0  # the token id of packed padding (never attended to, so any id would do; 0 as in the padded batches)


@struct.dataclass
class Block:
    tokens: jax.Array          # [B, L]
    positions: jax.Array       # [B, L]
    limit: jax.Array           # [B, L]
    group: jax.Array           # [B, L]
    score_index: jax.Array     # [B, K]: the last token of each copy, where the judge words are read
    boundary_index: jax.Array  # [B, K + 1]: draft token b_k - 1 (its logits follow boundary k); last: `before`
    valid: jax.Array           # [B, K]: a real prefix (k < count)
    num_tokens: jax.Array      # [B]: the block's real length, seq_len + count * S


def pack_block(ctx_len: jax.Array, seq: jax.Array, seq_len: jax.Array, bounds: jax.Array, count: jax.Array,
               suffix: jax.Array, length: int, before: jax.Array | None = None) -> Block:
    """The verification block of every row (see the module docstring); `before[b]`: the block index whose logits
    fill the last column of `boundary_index` (default 0). Padding tokens are `PAD_ID`."""
    b, w = seq.shape
    k = bounds.shape[1]
    s = suffix.shape[0]
    i = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (b, length))
    seq_len_ = seq_len[:, None]
    in_seq = i < seq_len_
    r = i - seq_len_
    copy = jnp.clip(r // s, 0, k - 1)
    j = jnp.where(in_seq, 0, r % s)
    in_copy = ~in_seq & (r < count[:, None] * s)
    b_k = jnp.take_along_axis(bounds, copy, axis=1)
    ctx = ctx_len[:, None]
    tokens = jnp.where(in_seq, jnp.take_along_axis(seq, jnp.minimum(i, w - 1), axis=1),
                       jnp.where(in_copy, suffix[j], PAD_ID))
    positions = jnp.where(in_seq, ctx + i, ctx + b_k + j)
    limit = jnp.where(in_seq, i + 1, jnp.where(in_copy, b_k, 0))
    group = jnp.where(in_seq, 0, jnp.where(in_copy, copy + 1, PAD_GROUP))
    # padding repeats the last real position: RoPE of padding is never read
    last = jnp.take_along_axis(positions, jnp.maximum(seq_len + count * s - 1, 0)[:, None], axis=1)
    real = in_seq | in_copy
    positions = jnp.where(real, positions, last)
    kk = jnp.arange(k, dtype=jnp.int32)[None, :]
    valid = kk < count[:, None]
    score_index = jnp.where(valid, seq_len_ + s * (kk + 1) - 1, 0)
    boundary_index = jnp.where(valid, bounds - 1, 0)
    before = jnp.zeros((b,), jnp.int32) if before is None else before
    boundary_index = jnp.concatenate([boundary_index, before[:, None]], axis=1)
    return Block(tokens=tokens.astype(jnp.int32), positions=positions.astype(jnp.int32),
                 limit=limit.astype(jnp.int32), group=group.astype(jnp.int32), score_index=score_index,
                 boundary_index=boundary_index.astype(jnp.int32), valid=valid,
                 num_tokens=seq_len + count * s)
