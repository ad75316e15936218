"""The static shapes a verification round writes within: a later round's block holds its real tokens (the last
token, its draft, its suffix copies, as `pack_block` lays them out) below `later_block_reach`, and a multi-round
program's caches hold every real token it can write (padding past the end is dropped, `models/cache.write_block`)."""

import pytest

from parse_jax.modes.parse_multi import multi_shape
from parse_jax.verify.round import later_block_reach
from tests.test_engine import DRAFT, TARGET


@pytest.mark.parametrize("prompt,max_new,cap,copies", [(32, 96, 64, 24), (8, 5, 64, 16), (16, 200, 32, 40),
                                                        (64, 17, 12, 3)])
def test_a_later_block_s_real_tokens_never_reach_past_its_bound_and_the_bound_is_reached(prompt, max_new, cap,
                                                                                          copies):
    ends = [prompt + num - 1 + 1 + draft + count  # every row state a later round can meet
            for num in range(1, max_new) for draft in range(1, min(cap, max_new - num) + 1)
            for count in range(0, copies + 1)]
    assert max(ends, default=0) == later_block_reach(prompt, max_new, cap, copies)


def test_the_caches_hold_every_block_s_real_tokens_and_every_written_token():
    from parse_jax.engine import ParseConfig, ParseEngine

    ctx = ParseEngine(TARGET, DRAFT, ParseConfig(rounds="multi", max_draft_tokens=12)).context
    copies = ctx.round_spec.max_prefixes * len(ctx.suffix_ids)
    for max_new in (3, 20, 64):
        shape = multi_shape(ctx, 16, max_new)
        reach = later_block_reach(16, max_new, min(12, shape.draft_new), copies)
        assert shape.cache_len >= max(reach, shape.first_lengths[-1], 16 + max_new + 1)
