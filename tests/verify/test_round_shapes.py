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


@pytest.mark.parametrize("longest", [8, 40, 96, 200])
def test_the_host_picks_the_block_length_the_device_branch_takes(longest):
    """`pick_length` (a staged round's host) against `verify_round`'s branch index on the device, for every need
    up to past the longest bucket (the longest then takes it)."""
    import jax.numpy as jnp

    from parse_jax.verify.round import block_lengths, pick_length

    lengths = block_lengths(longest)
    for needed in range(0, lengths[-1] + 6):
        branch = int(jnp.minimum(jnp.sum(jnp.asarray(lengths) < needed), len(lengths) - 1))
        assert pick_length(lengths, needed) == lengths[branch], (lengths, needed)


@pytest.mark.parametrize("prefix_choice", ["spread", "confidence", "auto"])
def test_a_staged_draft_needs_the_block_its_pass_packs_and_is_cut_as_the_pass_would_cut_it(prefix_choice):
    """The block length the draft program reports is the longest row's block in its pass; the pass scores the
    prefixes the draft program cut, and those are the ones it would cut itself (float cut points under "auto"
    included)."""
    import numpy as np

    from parse_jax.engine import ParseConfig, ParseEngine
    from parse_jax.modes.parse import stage_program, staged_launch
    from parse_jax.runtime.programs import fetch
    from tests.test_engine import PROMPTS

    eng = ParseEngine(TARGET, DRAFT, ParseConfig(rounds="single", max_draft_tokens=12, prefix_choice=prefix_choice,
                                                 segmenter="stride", stride=3, max_prefixes=4))
    req = eng.request(PROMPTS, "parse", 12, 0.0, 0, 0, 1.0, None)
    launch = staged_launch(eng.context, req)
    answer, needed = stage_program(launch.staged.draft)(*launch.draft_args)
    longest = stage_program(launch.staged.verifier(launch.staged.lengths[-1]))
    cut = fetch(longest(*launch.pass_args(answer)))
    recut = fetch(longest(*launch.pass_args(answer.replace(bounds=None, count=None))))
    assert int(fetch(needed)) == int(np.max(cut["block_tokens"][: len(PROMPTS)])) > 0
    assert np.array_equal(cut["prefixes"], fetch(answer.count)) and np.array_equal(recut["prefixes"], cut["prefixes"])
    assert np.array_equal(recut["accepted"], cut["accepted"]) and cut["prefixes"][: len(PROMPTS)].max() > 1
