"""`prefix_choice="confidence"` through the engine's programs (the selection itself: tests/verify/test_segment.py;
the draft's probabilities: tests/runtime/test_decode.py): where K holds every step end and any confidence qualifies
it verifies what "spread" verifies; with a cutoff no step clears it verifies the full draft alone, in single- and
multi-round parse and sequential; everything rejected, it is the target alone. `prefix_choice="auto"` likewise, with
the price of a prefix (the cost model's) set: free, it keeps every end; priced out, the full draft alone."""

import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import InputError
from parse_jax.runtime.decode import generate
from parse_jax.runtime.programs import compiled_programs
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


@pytest.fixture
def priced(monkeypatch):
    """Set the price of a verified prefix the engine hands its programs (the cost model's figure, replaced); the
    returned list holds the keyword arguments of each pricing."""
    asked = []

    def set_price(price: float):
        def fixed(costs, **kw):
            asked.append(kw)
            return price
        monkeypatch.setattr("parse_jax.engine.prefix_price", fixed)
        return asked
    return set_price


def test_auto_at_no_price_verifies_what_spread_verifies(priced):
    """prefix_choice="auto" with every end free and room for all of them keeps every step end, as spread does."""
    priced(0.0)
    spread = _run("parse", "multi", max_prefixes=8)
    auto = _run("parse", "multi", max_prefixes=8, prefix_choice="auto")
    _same(auto, spread)
    assert auto.stats["prefix_price"] == 0.0 and "prefix_price" not in spread.stats


@pytest.mark.parametrize("mode,rounds", [("parse", "single"), ("parse", "multi"), ("sequential", "multi")])
def test_auto_where_no_end_pays_verifies_the_full_draft_alone(priced, mode, rounds):
    asked = priced(1e9)
    res = _run(mode, rounds, max_prefixes=8, prefix_choice="auto")
    one_each = res.stats["checks_per_request"] if mode == "parse" else [1] * len(PROMPTS)
    assert res.stats["prefixes_per_request"] == one_each, res.stats
    assert res.stats["prefix_price"] == 1e9
    # priced at the rows the programs run (3 prompts: a bucket of 4); sequential pays a pass per prefix
    assert asked == [dict(batch=4, draft_tokens=16, suffix_tokens=asked[0]["suffix_tokens"],
                          cache_len=asked[0]["cache_len"], separate_passes=mode == "sequential")]


def test_a_new_price_compiles_nothing(priced):
    """The price is a traced input: a batch priced differently runs the programs the first one compiled."""
    priced(0.0)
    free = _run("parse", "multi", max_prefixes=8, prefix_choice="auto")
    before = compiled_programs()
    priced(1e9)
    dear = _run("parse", "multi", max_prefixes=8, prefix_choice="auto")
    assert compiled_programs() == before
    assert sum(dear.stats["prefixes_per_request"]) < sum(free.stats["prefixes_per_request"])


def test_auto_at_the_cost_models_price_with_everything_rejected_is_the_target_alone():
    res = _run("parse", "multi", threshold=1.0, max_prefixes=4, prefix_choice="auto")
    assert res.tokens == generate(TARGET, PROMPTS, max_new_tokens=16).tokens
    assert res.stats["prefix_price"] >= 0.0


def test_host_boundaries_under_auto(priced):
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**BASE, max_prefixes=8, prefix_choice="auto"))
    draft = [5, 6, 7, 5, 6, 7, 5, 6]  # stride 3: ends at 3, 6 and the full draft (8)
    priced(1.0)
    assert eng.boundaries(draft, [0.999] * 8) == [8]  # a sure draft pays for no other prefix
    priced(3.0)  # the doubt after 6: end 6 keeps 6 x 0.98 x 0.8 = 4.7 tokens, end 3 only 3 x 0.99 x 0.8 = 2.4
    assert eng.boundaries(draft, [0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.2, 0.99]) == [6, 8]
    priced(0.0)
    assert eng.boundaries(draft, [0.999] * 8) == [3, 6, 8]
    with pytest.raises(InputError, match="prefix_choice 'auto' chooses by the draft's token probabilities"):
        eng.boundaries(draft)
