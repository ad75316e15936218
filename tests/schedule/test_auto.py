"""`schedule="auto"` on synthetic cost tables: plain decoding where speculation is predicted (or measured) to lose,
the requested mode where it wins, calibration by the other choice's measurement, one exploration, fixed knobs kept."""

import dataclasses
import math

import pytest

from parse_jax.schedule.auto import (
    CONFIRM,
    CONTESTED,
    KEEP,
    SPECULATION_MARGIN,
    Outlook,
    ScheduleState,
    SetupCharge,
    choose,
    worth_measuring,
)
from parse_jax.schedule.policy import AcceptanceStats, Knobs, Workload, decide
from tests.schedule.test_policy import COMPUTE_BOUND, MEMORY_BOUND, STEP, costs, table

KNOBS = Knobs(draft_tokens=64, prefixes=8, rounds="multi", gamma=4, eagle3_gamma=5)


def _choose(state, table, batch, **kw):
    workload = Workload(batch=batch, cache_len=256, suffix_tokens=4, remaining_tokens=64)
    outlook = Outlook(charge=kw.pop("charge", None), windows_after=kw.pop("windows_after", math.inf))
    return choose(state, costs(table), mode=kw.pop("mode", "parse"), knobs=KNOBS, workload=workload, outlook=outlook,
                  **kw)


def test_speculates_where_blocks_are_cheap_and_decodes_plainly_where_they_cost_their_tokens():
    fresh = ScheduleState()
    assert _choose(fresh, MEMORY_BOUND, 1).run == "parse"
    plain = _choose(fresh, COMPUTE_BOUND, 16)
    assert plain.run == "target" and not plain.speculate
    assert plain.as_dict()["why"] == "prediction" and plain.estimate["target"] < plain.estimate["parse"]
    for mode in ("sd", "eagle3", "parse+eagle3", "sequential"):
        assert _choose(fresh, COMPUTE_BOUND, 16, mode=mode).run == "target"
        assert _choose(fresh, MEMORY_BOUND, 1, mode=mode).run == mode


def test_a_measured_loss_overrides_the_prediction():
    state = ScheduleState()
    assert _choose(state, MEMORY_BOUND, 4).run == "parse"  # predicted to win
    # it ran and was slow (measured 3x the target's predicted cost), and the target was measured too
    state = state.record("parse", 4, {"new_tokens": 100, "seconds": 0.3})
    state = state.record("target", 4, {"new_tokens": 100, "seconds": 0.1})
    after = _choose(state, MEMORY_BOUND, 4)
    assert after.run == "target" and after.as_dict()["why"] == "measured"
    assert after.estimate == {"parse": pytest.approx(0.012), "target": pytest.approx(0.004)}
    assert _choose(state, MEMORY_BOUND, 1).run == "parse"  # other batch sizes keep their own figures


def test_speculation_runs_only_where_it_beats_plain_decoding_by_more_than_the_noise():
    """Measured 5% faster than plain decoding is within one timed batch's noise: plain decoding. 20% faster: the
    mode."""
    plain = ScheduleState().record("target", 8, {"new_tokens": 100, "seconds": 0.1})
    near = plain.record("parse", 8, {"new_tokens": 100, "seconds": (1 - SPECULATION_MARGIN / 2) * 0.1})
    assert _choose(near, COMPUTE_BOUND, 8).run == "target"
    ahead = plain.record("parse", 8, {"new_tokens": 100, "seconds": (1 - 2 * SPECULATION_MARGIN) * 0.1})
    assert _choose(ahead, COMPUTE_BOUND, 8).run == "parse"


def test_plain_decoding_is_measured_before_a_speculative_choice_is_trusted_over_it():
    """Measured parse 4x over its prediction calibrates the target's estimate 4x up too, far beyond EXPLORE_RATIO of
    parse's figure: the baseline is explored anyway, and then the two measured figures decide."""
    flat = table(lambda b, t: STEP)  # a pass costs one step whatever its tokens: parse predicted far ahead
    predicted = _choose(ScheduleState(), flat, 8).predicted
    assert predicted["target"] > 2 * predicted["parse"]
    per_token = 4 * predicted["parse"]  # measured (served over 8 slots) at 4x its prediction
    state = ScheduleState().record("parse", 8, {"new_tokens": 800, "seconds": per_token * 100})
    c = _choose(state, flat, 8)
    assert c.estimate["parse"] == pytest.approx(per_token) and c.estimate["target"] > 2 * per_token
    assert c.run == "parse"
    explored = _choose(state, flat, 8, explore=True)
    assert explored.explored and explored.run == "target"
    charged = _choose(state, flat, 8, explore=True, charge=SetupCharge({"target": 100.0}, 10.0))
    assert charged.run == "parse" and not charged.explored  # in a job whose rows cannot pay its setup back
    measured = state.record("target", 8, {"new_tokens": 800, "seconds": per_token * 90})  # 10% faster than parse
    after = _choose(measured, flat, 8, explore=True)
    assert after.run == "target" and not after.explored


def test_one_measurement_calibrates_the_other_and_exploration_measures_it():
    state = ScheduleState().record("parse", 8, {"new_tokens": 80, "seconds": 0.2})
    c = _choose(state, MEMORY_BOUND, 8)
    assert c.as_dict()["why"] == "calibrated prediction"
    scale = c.measured["parse"] / c.predicted["parse"]
    assert c.estimate["target"] == pytest.approx(c.predicted["target"] * scale)
    assert not c.explored
    explored = _choose(state, MEMORY_BOUND, 8, explore=True)
    assert explored.explored and explored.run == "target"  # within EXPLORE_RATIO: measure plain decoding once


def test_a_run_whose_drafts_were_never_accepted_does_not_calibrate_plain_decoding_up():
    """PARSE ran (its cost as the model predicts it at zero acceptance: the hardware is as the table says) and no
    step of its was accepted. Set against the prior's prediction (0.7 per step) it looks 1.4x slow; that is the
    acceptance's error, not the hardware's, and plain decoding's estimate stays its prediction: it is chosen, also
    in a last batch that explores nothing."""
    cheap_blocks = table(lambda b, t: STEP + STEP * 0.01 * b * t)
    workload = Workload(batch=1, cache_len=256, suffix_tokens=4, remaining_tokens=64)
    never = AcceptanceStats(steps_verified=1000, steps_accepted=0)
    truth = {c.mode: c.seconds_per_token for c in decide(
        costs(cheap_blocks), dataclasses.replace(workload, step_tokens=10.0), never,
        dataclasses.replace(KNOBS, mode="parse")).alternatives}
    assert truth["parse"] > truth["target"]
    state = ScheduleState().record("parse", 1, {"new_tokens": 100, "seconds": truth["parse"] * 100,
                                                "draft_tokens": 80, "accepted_tokens": 0,
                                                "prefixes_per_request": [8], "verify_passes": 5})
    assert state.step_tokens == pytest.approx(10.0) and state.acceptance.step_rate > 0.4  # the prior still weighs
    c = _choose(state, cheap_blocks, 1)
    assert c.predicted["parse"] < truth["parse"] / 1.3  # the prior's prediction is that far off
    assert c.estimate["target"] == pytest.approx(truth["target"], rel=0.01)
    assert c.run == "target"


def test_plain_decoding_is_never_second_guessed_and_counts_acceptance():
    assert _choose(ScheduleState(), MEMORY_BOUND, 1, mode="target").run == "target"
    state = ScheduleState().record("parse", 1, {"new_tokens": 50, "seconds": 0.1, "draft_tokens": 60,
                                                "accepted_tokens": 48, "prefixes_per_request": [5],
                                                "verify_passes": 2})
    assert state.step_tokens == pytest.approx(12.0)
    assert state.acceptance.steps_accepted == 4 and state.acceptance.steps_verified == 5


# a chain run of 10 drafts of 4 tokens: 25 accepted, 4 drafts accepted whole, so 6 rejected tokens were judged
CHAIN_RUN = {"new_tokens": 35, "seconds": 0.1, "draft_tokens": 40, "accepted_tokens": 25, "num_drafts": 10,
             "num_accepted_tokens_per_pos": [9, 7, 5, 4]}


def test_each_kind_of_draft_counts_its_own_acceptance_per_judged_token():
    """sd's counts go to the draft model's rate, EAGLE-3's to the head's (an eagle3 run priced at the prior forever,
    and sd then priced with the head's acceptance, before); judged tokens are the accepted ones and one per draft
    that had a rejection, not every token proposed (those past a rejection are never judged: counting them priced a
    good draft as a poor one)."""
    sd = ScheduleState().record("sd", 1, CHAIN_RUN).acceptance
    assert (sd.drafted, sd.accepted, sd.eagle3_drafted) == (31, 25, 0)
    e3 = ScheduleState().record("eagle3", 1, CHAIN_RUN).acceptance
    assert (e3.eagle3_drafted, e3.eagle3_accepted, e3.drafted) == (31, 25, 0)
    assert e3.as_seen().eagle3_rate == pytest.approx(25 / 31)
    parse_eagle = {"new_tokens": 60, "seconds": 0.1, "draft_tokens": 40, "accepted_tokens": 20,
                   "prefixes_per_request": [4], "verify_passes": 1, "request_checks": 1,
                   "eagle3_draft_tokens": 30, "eagle3_accepted_tokens": 12, "eagle3_num_drafts": 10}
    both = ScheduleState().record("parse+eagle3-single", 1, parse_eagle).acceptance
    assert (both.steps_accepted, both.steps_verified) == (2, 3)
    assert (both.eagle3_accepted, both.eagle3_drafted, both.drafted) == (12, 22, 0)


def test_a_batch_counts_one_rejection_per_request_as_its_rows_alone_would():
    """A verification pass over B rows judges B drafts: a batch's acceptance counts equal its rows run one at a
    time (the pass count alone made a batch of B look B times as accepting)."""
    row = {"new_tokens": 20, "seconds": 0.1, "draft_tokens": 50, "accepted_tokens": 20, "prefixes_per_request": [5],
           "verify_passes": 1, "request_checks": 1}
    alone = ScheduleState()
    for _ in range(4):
        alone = alone.record("parse-single", 1, row)
    batch = ScheduleState().record("parse-single", 4, {**row, "new_tokens": 80, "draft_tokens": 200,
                                                       "accepted_tokens": 80, "prefixes_per_request": [5] * 4,
                                                       "request_checks": 4})
    assert batch.acceptance == alone.acceptance
    assert (batch.acceptance.steps_accepted, batch.acceptance.steps_verified) == (8, 12)
    # where the run kept its first-rejected-step histogram, its rejections are read from it: 4 verifications, 2
    # of them with a rejected step
    hist = {**row, "num_verifications": 4, "first_rejected_step_hist": [1, 1, 0, 0, 0, 2]}
    assert ScheduleState().record("parse-multi", 1, hist).acceptance.steps_verified == 2 + 2


def test_a_head_whose_drafts_were_never_accepted_does_not_calibrate_plain_decoding_up():
    """The eagle3 twin of the test above: the head's run, at zero acceptance, is set against its prediction at the
    acceptance seen, so plain decoding's estimate stays its prediction."""
    workload = Workload(batch=1, cache_len=256, suffix_tokens=4, remaining_tokens=64)
    never = AcceptanceStats(eagle3_drafted=1000, eagle3_accepted=0)
    truth = {c.mode: c.seconds_per_token for c in decide(
        costs(MEMORY_BOUND), workload, never, dataclasses.replace(KNOBS, mode="eagle3")).alternatives}
    assert truth["eagle3"] > truth["target"]
    run = {"new_tokens": 100, "seconds": truth["eagle3"] * 100, "draft_tokens": 100, "accepted_tokens": 0,
           "num_drafts": 20, "num_accepted_tokens_per_pos": [0] * 5}
    state = ScheduleState().record("eagle3", 1, run)
    assert state.acceptance.eagle3_drafted == 20 and state.acceptance.drafted == 0
    c = _choose(state, MEMORY_BOUND, 1, mode="eagle3")
    assert c.estimate["target"] == pytest.approx(truth["target"], rel=0.01)
    assert c.run == "target"


def test_a_fixed_batch_is_measured_by_its_longest_row_and_a_served_run_by_its_mean():
    """Rows of a fixed batch that finish early idle until its longest row ends; a served run refills them. Both are
    measured as the seconds per token of one row with every row busy, so neither looks cheaper for its batching."""
    served = ScheduleState().record("target", 4, {"new_tokens": 400, "seconds": 1.0})
    fixed = ScheduleState().record("target", 4, {"new_tokens": 160, "seconds": 1.0}, longest=100)
    assert served.measured[("target", 4)] == pytest.approx(0.01)
    assert fixed.measured[("target", 4)] == pytest.approx(0.01)  # not 4 * 1.0 / 160 = 0.025


def test_a_served_figure_is_not_moved_by_fixed_batches_and_each_kind_pools_apart():
    """A choice's served figure stands whatever fixed batches of it read; each kind's median is of its own."""
    explored = ScheduleState().record("parse", 8, {"new_tokens": 640, "seconds": 1.0}, longest=100)
    assert explored.measured[("parse", 8)] == pytest.approx(0.01) and not explored.served
    served = explored.record("parse", 8, {"new_tokens": 400, "seconds": 1.0})
    assert served.measured[("parse", 8)] == pytest.approx(0.02)  # its served figure, not averaged with 0.01
    assert served.served == {("parse", 8)}
    again = served.record("parse", 8, {"new_tokens": 800, "seconds": 1.0}, longest=100)
    assert again.measured[("parse", 8)] == pytest.approx(0.02)  # a fixed batch leaves a served figure
    twice = served.record("parse", 8, {"new_tokens": 800, "seconds": 1.0})
    assert twice.measured[("parse", 8)] == pytest.approx(0.5 * 0.01 + 0.5 * 0.02)  # served runs average
    fixed = explored.record("parse", 8, {"new_tokens": 640, "seconds": 2.0}, longest=100)
    assert fixed.measured[("parse", 8)] == pytest.approx(0.015)  # fixed batches average among themselves


def test_a_choice_measured_only_in_fixed_batches_is_judged_in_served_terms():
    """What a short fixed batch reads against the same choice served differs (prefill, overhead, its slowest row):
    the embedded pair at batch 4 read plain decoding 7.1 ms per token-row in a fixed batch and 3.4 served,
    single-round PARSE 4.1 in a fixed batch. Compared raw, the served baseline wins; in served terms
    (4.1 x 3.4 / 7.1 = 2.0) PARSE does."""
    rounds = ("multi", "single")
    state = ScheduleState().record("target", 4, {"new_tokens": 100, "seconds": 0.71}, longest=100)
    state = state.record("parse-multi", 4, {"new_tokens": 100, "seconds": 0.65}, longest=100)
    state = state.record("parse-single", 4, {"new_tokens": 100, "seconds": 0.41}, longest=100)
    state = state.record("target", 4, {"new_tokens": 400, "seconds": 0.34})  # then served: 3.4 ms per token-row
    assert state.measured[("target", 4)] == pytest.approx(0.0034)
    assert state.measured[("parse-single", 4)] == pytest.approx(0.0041 * 0.34 / 0.71)
    assert state.measured[("parse-multi", 4)] == pytest.approx(0.0065 * 0.34 / 0.71)
    c = _choose(state, MEMORY_BOUND, 4, rounds=rounds)
    assert (c.run, c.rounds) == ("parse", "single")
    # served in turn and found slower than plain decoding: its own served figure decides
    slower = state.record("parse-single", 4, {"new_tokens": 400, "seconds": 0.40})
    assert slower.measured[("parse-single", 4)] == pytest.approx(0.004)
    assert _choose(slower, MEMORY_BOUND, 4, rounds=rounds).run == "target"
    fixed3 = state.record("parse-single", 4, {"new_tokens": 100, "seconds": 0.41}, longest=100)
    fixed3 = fixed3.record("parse-single", 4, {"new_tokens": 100, "seconds": 0.41}, longest=100)
    assert fixed3.count("parse-single", 4) == 3
    assert fixed3.record("parse-single", 4, {"new_tokens": 400, "seconds": 0.4}).count("parse-single", 4) == 1
    # the ratio is the median over the choices measured both ways
    both = state.record("parse-multi", 4, {"new_tokens": 400, "seconds": 0.26})  # served / fixed: 0.0026 / 0.0065
    ratio = (0.0034 / 0.0071 + 0.0026 / 0.0065) / 2
    assert both.measured[("parse-single", 4)] == pytest.approx(0.0041 * ratio)
    # a bucket with nothing served compares its fixed figures as they stand
    only_fixed = ScheduleState().record("parse-single", 8, {"new_tokens": 100, "seconds": 0.41}, longest=100)
    assert only_fixed.measured[("parse-single", 8)] == pytest.approx(0.0041)
    # one where something was served but no choice both ways cannot put a fixed figure in served terms: unmeasured,
    # so exploration measures it served
    mixed = only_fixed.record("target", 8, {"new_tokens": 800, "seconds": 0.272})
    assert ("parse-single", 8) not in mixed.measured and mixed.measured[("target", 8)] == pytest.approx(0.00272)
    assert _choose(mixed, MEMORY_BOUND, 8, rounds=rounds, explore=True).explored


def test_free_rounds_are_two_choices_measured_under_their_own_names():
    rounds = ("multi", "single")
    fresh = _choose(ScheduleState(), MEMORY_BOUND, 4, rounds=rounds, explore=True)
    assert set(fresh.predicted) == {"target", "parse-multi", "parse-single"}
    best = min(fresh.predicted, key=fresh.predicted.get)
    assert fresh.explored and fresh.name == best  # nothing measured here: the predicted best runs a batch alone
    assert not _choose(ScheduleState(), MEMORY_BOUND, 4, rounds=rounds).explored  # a single batch never explores
    # multi measured slow: single, unmeasured but predicted near the best measured, is explored, then wins measured
    state = ScheduleState().record("parse-multi", 4, {"new_tokens": 100, "seconds": 0.5})
    state = state.record("target", 4, {"new_tokens": 100, "seconds": 0.2})
    explored = _choose(state, MEMORY_BOUND, 4, rounds=rounds, explore=True)
    assert (explored.run, explored.rounds, explored.explored) == ("parse", "single", True)
    state = state.record("parse-single", 4, {"new_tokens": 100, "seconds": 0.1})
    after = _choose(state, MEMORY_BOUND, 4, rounds=rounds, explore=True)
    assert (after.run, after.rounds, after.explored, after.as_dict()["why"]) == ("parse", "single", False, "measured")
    state = state.record("parse-single", 4, {"new_tokens": 100, "seconds": 0.9})  # now slower than plain decoding
    assert _choose(state, MEMORY_BOUND, 4, rounds=rounds).run == "target"


def test_a_job_pays_setup_only_where_its_remaining_steps_pay_it_back():
    """Inside a one-off job each choice not yet set up costs its setup seconds spread over the job's remaining steps:
    a short job keeps plain decoding (and does not explore the mode), a long one speculates; without a charge (an
    engine's life) the setup is not counted."""
    fresh = ScheduleState()
    win = _choose(fresh, MEMORY_BOUND, 1)
    assert win.run == "parse" and win.setup == {}
    gain = win.estimate["target"] - win.estimate["parse"]  # seconds per step the mode saves
    setup = {"parse": 60.0, "target": 5.0}
    short = (setup["parse"] - setup["target"]) / gain / 2  # half the steps that would pay the difference back
    for explore in (False, True):
        c = _choose(fresh, MEMORY_BOUND, 1, charge=SetupCharge(setup, short), explore=explore)
        assert c.run == "target", explore
        assert c.setup == {"parse": pytest.approx(60 / short), "target": pytest.approx(5 / short)}
        assert c.as_dict()["setup_seconds_per_token"] == c.setup
    assert _choose(fresh, MEMORY_BOUND, 1, charge=SetupCharge(setup, 4 * short)).run == "parse"
    # plain decoding measured and set up; the mode's setup unknown: explored as before (its figure is learned)
    state = fresh.record("target", 1, {"new_tokens": 100, "seconds": 100 * win.estimate["target"]})
    c = _choose(state, MEMORY_BOUND, 1, charge=SetupCharge({}, short), explore=True)
    assert c.run == "parse" and c.explored
    # known and not paid back: not explored; paid back: explored
    assert _choose(state, MEMORY_BOUND, 1, charge=SetupCharge({"parse": 60.0}, short), explore=True).run == "target"
    c = _choose(state, MEMORY_BOUND, 1, charge=SetupCharge({"parse": 60.0}, 100 * short), explore=True)
    assert c.run == "parse" and c.explored


def _ran(state, name, batch, per_token):
    """`state` with a served run of `name` at `per_token` seconds per token-row counted in."""
    return state.record(name, batch, {"new_tokens": 100 * batch, "seconds": 100 * per_token})


def test_a_close_call_measures_the_other_side_again_once_per_call_until_it_has_several_measurements():
    """Plain decoding is truly 6% faster than parse here, but its first measurement was unlucky (50% slow), so parse
    serves. One measurement of each side cannot tell such costs apart on a shared machine: the side not serving is
    measured again, one batch per call, until each side has CONFIRM measurements; then the medians decide (plain
    decoding) and nothing more is explored."""
    true = {"target": 0.008, "parse": 0.0085}
    state = _ran(_ran(ScheduleState(), "target", 8, 1.5 * true["target"]), "parse", 8, true["parse"])
    assert _choose(state, COMPUTE_BOUND, 8).run == "parse"
    explored = []
    for _ in range(4 * CONFIRM):  # calls: each explores (at most one batch) and serves the pick
        state = state.new_call()
        c = _choose(state, COMPUTE_BOUND, 8, explore=True)
        if c.explored:
            explored.append(c.run)
            state = _ran(state, c.run, 8, true[c.run])
            again = _choose(state, COMPUTE_BOUND, 8, explore=True)
            assert not (again.explored and again.run == c.run)  # not twice in one call
            c = again
        if not c.explored:
            state = _ran(state, c.run, 8, true[c.run])
    assert explored and len(explored) <= 2 * CONFIRM
    assert min(state.count("target", 8), state.count("parse", 8)) >= CONFIRM - 1
    final = _choose(state.new_call(), COMPUTE_BOUND, 8, explore=True)
    assert (final.run, final.explored) == ("target", False)
    assert not _choose(ScheduleState(), COMPUTE_BOUND, 8).explored  # a single batch never explores


def test_a_clear_decision_does_not_measure_again_and_one_outlier_does_not_move_a_median():
    far = 1.0 + 2 * CONTESTED
    state = _ran(_ran(ScheduleState(), "target", 8, 0.010 * far), "parse", 8, 0.005).new_call()
    assert not _choose(state, COMPUTE_BOUND, 8, explore=True).explored  # parse far ahead: no close call
    for _ in range(KEEP - 1):
        state = _ran(state, "parse", 8, 0.005)
    noisy = _ran(state, "parse", 8, 0.05)  # one batch 10x slow (the machine was busy)
    assert noisy.measured[("parse", 8)] == pytest.approx(0.005)
    assert _choose(noisy, COMPUTE_BOUND, 8).run == "parse"
    for _ in range(KEEP):  # a lasting change does move it
        noisy = _ran(noisy, "parse", 8, 0.05)
    assert noisy.count("parse", 8) == KEEP and _choose(noisy, COMPUTE_BOUND, 8).run == "target"


def test_measuring_a_close_call_again_must_pay_for_its_window():
    """A near tie is worth a window in any call; a choice 30% behind only where much work follows (its window costs
    30% for sure, the chance it is truly ahead is small); more measurements make the same gap less worth it."""
    assert worth_measuring(0.02, (1, 1), 1.0)
    assert not worth_measuring(0.3, (1, 1), 3.0)
    assert worth_measuring(0.3, (1, 1), 1000.0)
    assert worth_measuring(0.15, (1, 1), 10.0) and not worth_measuring(0.15, (2, 5), 10.0)
    # through choose: plain decoding measured 30% slower than parse (after the margin), contested
    state = _ran(_ran(ScheduleState(), "target", 8, 0.0085 * 1.3 / (1 - SPECULATION_MARGIN)), "parse", 8, 0.0085)
    state = state.new_call()
    assert _choose(state, COMPUTE_BOUND, 8, explore=True).explored  # no bound on the work left: measured again
    short = _choose(state, COMPUTE_BOUND, 8, explore=True, windows_after=3.0)
    assert (short.run, short.explored) == ("parse", False)
    assert _choose(state, COMPUTE_BOUND, 8, explore=True, windows_after=1e4).explored
