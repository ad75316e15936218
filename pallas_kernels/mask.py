"""docs/design.md §2's visibility rule, written once for the reference and both kernel bodies.

Query i of row b sees every context slot s < lengths[b], and the block token j = s - lengths[b] when
`(group[j] == 0 and j < limit[i]) or (group[j] == group[i] != 0 and j <= i)`. Padding has group
`parse_jax.verify.block.PAD_GROUP` (-1): neither clause matches it for a real query (group >= 0); a padding query
may see earlier padding keys, which changes no real query's output.

`visible` is plain elementwise jnp over broadcastable arrays: the reference calls it on a dense [B, T, S]
grid, the kernels on one loaded (query block, key block) tile, so a change to the rule lands everywhere.
"""

from __future__ import annotations

import jax


def visible(slot: jax.Array, ctx_len: jax.Array, key_group: jax.Array, query_group: jax.Array,
            query_i: jax.Array, query_limit: jax.Array, num_tokens: int, num_slots: int | None = None) -> jax.Array:
    """Boolean, broadcast of the inputs: may query `query_i` (group `query_group`, limit `query_limit`) see `slot`.

    `key_group` is the group of the block token stored at `slot` (`block_map.key_groups_by_slot`); it is only
    read for slots in [ctx_len, ctx_len + num_tokens), so any value is fine elsewhere. `num_slots`, when given,
    hides slots at or past it (the padded tail of a kernel's last key block).
    """
    j = slot - ctx_len
    in_block = (j >= 0) & (j < num_tokens)
    shared = (key_group == 0) & (j < query_limit)
    own = (key_group == query_group) & (query_group != 0) & (j <= query_i)
    out = (j < 0) | (in_block & (shared | own))
    return out if num_slots is None else (slot < num_slots) & out
