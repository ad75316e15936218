"""The static shapes a verification round writes within: a later round's block, padded as `verify_round` pads it
(the shortest of its lengths that holds the real block, the longest where none does), never reaches past
`later_block_reach`, and a multi-round program's caches hold every block it can write."""

import pytest

from parse_jax.modes.parse_multi import multi_shape
from parse_jax.verify.round import block_lengths, later_block_reach
from tests.test_engine import DRAFT, TARGET


def _padded(lengths, need):  # verify_round's branch: sum(lengths < need), at most the last
    return lengths[min(sum(n < need for n in lengths), len(lengths) - 1)]


@pytest.mark.parametrize("prompt,max_new,cap,copies", [(32, 96, 64, 24), (8, 5, 64, 16), (16, 200, 32, 40),
                                                        (64, 17, 12, 3)])
def test_a_later_block_never_reaches_past_its_bound_and_the_bound_is_reached(prompt, max_new, cap, copies):
    lengths = block_lengths(1 + min(cap, max_new) + copies)
    ends = [prompt + num - 1 + _padded(lengths, 1 + draft + count)  # every row state a later round can meet
            for num in range(1, max_new) for draft in range(1, min(cap, max_new - num) + 1)
            for count in range(0, copies + 1)]
    assert max(ends, default=0) == later_block_reach(prompt, max_new, cap, copies, lengths)


def test_one_row_s_caches_are_sized_by_its_own_blocks_and_several_rows_by_the_longest():
    from parse_jax.engine import ParseConfig, ParseEngine

    ctx = ParseEngine(TARGET, DRAFT, ParseConfig(rounds="multi", max_draft_tokens=12)).context
    copies = ctx.round_spec.max_prefixes * len(ctx.suffix_ids)
    for max_new in (3, 20, 64):
        one, two = multi_shape(ctx, 16, max_new, rows=1), multi_shape(ctx, 16, max_new, rows=2)
        reach = later_block_reach(16, max_new, min(12, one.draft_new), copies, one.lengths)
        assert one.cache_len >= max(reach, one.first_lengths[-1], 16 + max_new + 1)
        assert two.cache_len >= 16 + max_new + two.lengths[-1] + 1 and two.cache_len >= one.cache_len
