"""The speculation policy on synthetic cost tables (no dependence on this machine's speed)."""

import dataclasses
import math

import pytest

from parse_jax.errors import ConfigError
from parse_jax.schedule.costs import CostTable, PassCosts
from parse_jax.schedule.policy import (
    AcceptanceStats,
    Knobs,
    Prior,
    Workload,
    decide,
    expected_accepted_tokens,
    expected_chain_tokens,
)
from parse_jax.settings import ParseConfig

STEP = 5e-3  # a target step: 5 ms


def table(fn) -> CostTable:
    batches, tokens, caches = (1, 4, 16, 64), (1, 8, 16, 32, 64, 128, 256), (64, 512)
    return CostTable(batches, tokens, caches, [[[fn(b, t) for _ in caches] for t in tokens] for b in batches])


# weight-bound (batch 1 on the CPU): a pass reads the weights once for all its tokens; 48 tokens cost ~2.4 steps
MEMORY_BOUND = table(lambda b, t: STEP + STEP * 0.03 * b * t)
# compute-bound (batch 16 on the CPU): a pass of T tokens costs T steps
COMPUTE_BOUND = table(lambda b, t: STEP * t)
DRAFT = table(lambda b, t: 2e-4 + 1e-5 * b * t)
HEAD = table(lambda b, t: 5e-4 + 5e-5 * b * t)


def costs(target: CostTable, eagle3: bool = True) -> PassCosts:
    return PassCosts(target=target, draft=DRAFT, eagle3=HEAD if eagle3 else None)


def test_synthetic_regimes_are_what_they_claim():
    assert MEMORY_BOUND.seconds(1, 48, 64) / MEMORY_BOUND.seconds(1, 1, 64) == pytest.approx(2.4, rel=0.05)
    assert COMPUTE_BOUND.seconds(16, 48, 64) / COMPUTE_BOUND.seconds(16, 1, 64) == pytest.approx(48)


def test_speculates_where_a_block_costs_a_few_steps():
    d = decide(costs(MEMORY_BOUND), Workload(batch=1, cache_len=256))
    assert d.speculate and d.choice.mode != "target"
    target = next(c for c in d.alternatives if c.mode == "target")
    assert d.choice.seconds_per_token < 0.6 * target.seconds_per_token
    assert d.alternatives[0] == d.choice and {c.mode for c in d.alternatives} == {
        "target", "sd", "eagle3", "parse", "parse+eagle3"}


def test_plain_decoding_where_verification_costs_its_tokens_in_steps():
    d = decide(costs(COMPUTE_BOUND), Workload(batch=16, cache_len=256))
    assert not d.speculate and d.choice.mode == "target"
    assert d.choice.seconds_per_token == pytest.approx(STEP)
    assert all(c.seconds_per_token >= d.choice.seconds_per_token for c in d.alternatives)
    assert d.reason.startswith("target: predicted ms/token target 5")
    assert set(d.as_dict()["seconds_per_token"]) == {"target", "sd", "eagle3", "parse", "parse+eagle3"}


def test_parse_chosen_over_token_speculation_when_steps_are_reliable():
    stats = AcceptanceStats(drafted=100, accepted=30, steps_verified=100, steps_accepted=98)
    d = decide(costs(MEMORY_BOUND, eagle3=False), Workload(batch=1, cache_len=256), stats)
    assert d.choice.mode == "parse" and d.choice.draft_tokens >= 32 and d.choice.prefixes >= 2


def test_more_acceptance_drafts_more():
    w, c = Workload(batch=1, cache_len=256), costs(MEMORY_BOUND, eagle3=False)
    knobs = Knobs(mode="parse", rounds="multi")
    low = decide(c, w, AcceptanceStats(steps_verified=100, steps_accepted=40), knobs).choice
    high = decide(c, w, AcceptanceStats(steps_verified=100, steps_accepted=97), knobs).choice
    assert high.draft_tokens > low.draft_tokens


def test_explicit_settings_are_never_overridden():
    c, w = costs(COMPUTE_BOUND), Workload(batch=16, cache_len=256)
    knobs = Knobs(mode="parse", draft_tokens=32, prefixes=4, rounds="multi")
    d = decide(c, w, knobs=knobs)
    assert (d.choice.mode, d.choice.draft_tokens, d.choice.prefixes, d.choice.rounds) == ("parse", 32, 4, "multi")
    assert d.alternatives[0].mode == "target"  # what would have been faster is still reported
    assert d.fixed == ("mode", "draft_tokens", "prefixes", "rounds") and "fixed by the user" in d.reason
    sd = decide(costs(MEMORY_BOUND), Workload(batch=1, cache_len=256), knobs=Knobs(mode="sd", gamma=7)).choice
    assert (sd.mode, sd.gamma) == ("sd", 7)
    # auto mode with a fixed knob: the knob holds wherever it applies
    auto = decide(costs(MEMORY_BOUND), Workload(batch=1, cache_len=256), knobs=Knobs(draft_tokens=16, gamma=2))
    for alt in auto.alternatives:
        assert alt.mode not in ("parse", "parse+eagle3") or alt.draft_tokens == 16
        assert alt.mode != "sd" or alt.gamma == 2


def test_fixed_multi_round_prices_parse_eagle3_with_its_head_writing_the_step():
    w = Workload(batch=1, cache_len=256)
    d = decide(costs(MEMORY_BOUND), w, knobs=Knobs(rounds="multi"))
    assert all(c.rounds in (None, "multi") for c in d.alternatives)
    multi = decide(costs(MEMORY_BOUND), w, knobs=Knobs(mode="parse+eagle3", rounds="multi")).choice
    plain = decide(costs(MEMORY_BOUND), w, knobs=Knobs(mode="parse", rounds="multi", draft_tokens=multi.draft_tokens,
                                                       prefixes=multi.prefixes)).choice
    assert (multi.mode, multi.rounds) == ("parse+eagle3", "multi") and multi.gamma > 0
    # the same round, but the target's step written by EAGLE-3 chains: cheaper where the head's tokens are accepted
    assert multi.tokens_per_round == pytest.approx(plain.tokens_per_round)
    assert multi.round_seconds < plain.round_seconds


def test_knobs_from_settings():
    cfg = ParseConfig(max_draft_tokens=48, max_prefixes=3, rounds="single")
    knobs = Knobs.from_settings(cfg, fixed=("max_draft_tokens", "rounds"), mode="auto")
    assert knobs == Knobs(draft_tokens=48, rounds="single")
    assert Knobs.from_settings(cfg, fixed=(), mode="sd") == Knobs(mode="sd")
    with pytest.raises(ConfigError, match="threshold are no policy knobs"):
        Knobs.from_settings(cfg, fixed=("threshold",))
    with pytest.raises(ConfigError, match="unknown mode 'fast'"):
        Knobs(mode="fast")


def test_a_mode_without_its_costs_is_refused():
    with pytest.raises(ConfigError, match="mode 'eagle3' needs a cost for its EAGLE-3 head"):
        decide(costs(MEMORY_BOUND, eagle3=False), Workload(batch=1, cache_len=64), knobs=Knobs(mode="eagle3"))
    only_target = decide(PassCosts(target=MEMORY_BOUND), Workload(batch=1, cache_len=64))
    assert only_target.choice.mode == "target" and len(only_target.alternatives) == 1


def test_expected_accepted_tokens():
    a, n, step = 0.8, 6, 10.0
    closed = step * a * (1 - a**n) / (1 - a)  # a prefix at every step: sum_k a^k
    assert expected_accepted_tokens(a, n, n, step) == pytest.approx(closed)
    assert expected_accepted_tokens(a, n, 20, step) == pytest.approx(closed)  # no more prefixes than steps
    assert expected_accepted_tokens(a, n, 1, step) == pytest.approx(n * step * a**n)  # all or nothing
    assert expected_accepted_tokens(1.0, n, 3, step) == n * step and expected_accepted_tokens(0.0, n, 3, step) == 0
    assert expected_accepted_tokens(0.9, n, 3, step) > expected_accepted_tokens(0.7, n, 3, step)
    assert expected_accepted_tokens(0.8, n, 3, step) > expected_accepted_tokens(0.8, n, 1, step)


def test_expected_chain_tokens():
    assert expected_chain_tokens(0.0, 4) == 1.0 and expected_chain_tokens(1.0, 4) == 5.0
    assert expected_chain_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_acceptance_stats_prior_and_running_counts():
    s = AcceptanceStats(prior=Prior(step_rate=0.7, weight=8))
    assert s.step_rate == pytest.approx(0.7)
    s = s.update(steps_verified=1000, steps_accepted=100)
    assert math.isclose(s.step_rate, (100 + 5.6) / 1008)
    rows = [AcceptanceStats(drafted=10, accepted=5), AcceptanceStats(drafted=30, accepted=25)]
    pooled = AcceptanceStats.pooled(rows)
    assert (pooled.drafted, pooled.accepted) == (40, 30)
    assert dataclasses.replace(pooled, prior=Prior(weight=1e-9)).token_rate == pytest.approx(0.75)
    with pytest.raises(ConfigError, match="accepted must be <= 3"):
        AcceptanceStats(drafted=3, accepted=4)
    with pytest.raises(ConfigError, match="unknown acceptance count"):
        s.update(rejected=1)


def test_workload_refuses_bad_input():
    with pytest.raises(ConfigError, match="batch must be >= 1, got 0"):
        Workload(batch=0, cache_len=64)
    with pytest.raises(ConfigError, match="step_tokens must lie in"):
        Workload(batch=1, cache_len=64, step_tokens=0.5)
