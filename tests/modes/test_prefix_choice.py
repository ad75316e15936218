"""`prefix_choice="confidence"` through the engine's programs (the selection itself: tests/verify/test_segment.py;
the draft's probabilities: tests/runtime/test_decode.py): where K holds every step end and any confidence qualifies
it verifies what "spread" verifies; with a cutoff no step clears it verifies the full draft alone, in single- and
multi-round parse and sequential; everything rejected, it is the target alone."""

import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import InputError
from parse_jax.runtime.decode import generate
from tests.test_engine import DRAFT, TARGET

PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :"]
BASE = dict(max_draft_tokens=16, schedule="fixed", threshold=0.3, segmenter="stride", stride=3)


def _run(mode, rounds, **kw):
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**{**BASE, "rounds": rounds, **kw}))
    return eng.generate(PROMPTS, mode=mode, max_new_tokens=16)


def _same(a, b):
    assert a.tokens == b.tokens
    assert a.stats["accepted_per_request"] == b.stats["accepted_per_request"]
    assert a.stats["verify_passes"] == b.stats["verify_passes"]


def test_confidence_with_room_for_every_step_end_verifies_what_spread_verifies():
    spread = _run("parse", "single", max_prefixes=8)
    assert 0 < sum(spread.stats["accepted_per_request"])  # not vacuous: some prefixes are accepted
    _same(_run("parse", "single", max_prefixes=8, prefix_choice="confidence"), spread)


@pytest.mark.parametrize("mode,rounds", [("parse", "single"), ("parse", "multi"), ("sequential", "multi")])
def test_a_cutoff_no_step_clears_verifies_the_full_draft_alone(mode, rounds):
    """Every path that drafts (single round, multi round, sequential) hands the draft's probabilities to the
    segmenter: with cutoff 0 each verification holds one prefix, where "spread" at K = 8 holds several."""
    res = _run(mode, rounds, max_prefixes=8, prefix_choice="confidence", prefix_confidence=0.0)
    # parse: one prefix per verification; sequential drafts once per request and checks its prefixes one a pass
    one_each = res.stats["checks_per_request"] if mode == "parse" else [1] * len(PROMPTS)
    assert res.stats["prefixes_per_request"] == one_each, res.stats
    assert _run(mode, rounds, max_prefixes=8).stats["prefixes_per_request"] != one_each  # where spread verifies more


def test_everything_rejected_is_the_target_alone():
    res = _run("parse", "multi", threshold=1.0, max_prefixes=2, prefix_choice="confidence", prefix_confidence=0.9)
    assert res.tokens == generate(TARGET, PROMPTS, max_new_tokens=16).tokens


def test_host_boundaries_need_the_draft_probabilities():
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**BASE, max_prefixes=2, prefix_choice="confidence"))
    draft = [5, 6, 7, 5, 6, 7, 5, 6]  # stride 3: ends at 3, 6 and the full draft (8)
    assert eng.boundaries(draft, [0.9, 0.9, 0.9, 0.2, 0.9, 0.9, 0.8, 0.9]) == [3, 8]
    with pytest.raises(InputError, match="pass probs, one per draft token"):
        eng.boundaries(draft)
    with pytest.raises(InputError, match=r"probs\[1\]"):
        eng.boundaries(draft, [0.5, 1.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
