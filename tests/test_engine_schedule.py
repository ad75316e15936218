"""`ParseEngine.generate(max_batch=, schedule=)`: results in prompt order, continuous batching for plain decoding
and the speculative modes, the default schedule,
and `schedule="auto"` choosing plain decoding exactly where the cost model says speculation loses (synthetic cost
tables, so the test does not depend on this machine), with explicit settings kept as given."""

import dataclasses

import jax
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import InputError
from parse_jax.models.model import Model
from parse_jax.runtime import executables, programs
from parse_jax.runtime.decode import generate
from parse_jax.runtime.programs import _PROGRAMS, bucket, setup_split
from parse_jax.schedule.auto import EXPLORE_FILLS, EXPLORE_MIN_PROMPTS, SPECULATION_MARGIN, ScheduleState, choose
from parse_jax.schedule.setup import _LEDGERS, UNMEASURED_SECONDS, ledger, load_setup_costs
from tests.schedule.test_policy import COMPUTE_BOUND, MEMORY_BOUND, costs
from tests.test_engine import DRAFT, TARGET

PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :", "( 2 + 2 ) :",
           "( 9 - 1 ) * ( 3 + 3 ) :", "( 4 * 4 ) - ( 1 + 0 ) :", "( 8 + 1 ) :"]


def _engine(**kw):
    return ParseEngine(TARGET, DRAFT, ParseConfig(**{"max_draft_tokens": 12, "rounds": "multi", "schedule": "fixed",
                                                     **kw}))


def _measured(seconds: dict[str, float], batch: int) -> ScheduleState:
    """A fresh schedule state with one served measurement of 20 tokens per choice at `batch`."""
    state = ScheduleState()
    for name, s in seconds.items():
        state = state.record(name, batch, {"new_tokens": 20, "seconds": s})
    return state


def test_plain_decoding_in_slots_equals_each_prompt_alone_in_prompt_order():
    eng = _engine()
    alone = [generate(TARGET, [p], max_new_tokens=14).tokens[0] for p in PROMPTS]
    res = eng.generate(PROMPTS, mode="target", max_new_tokens=14, max_batch=3)
    assert res.tokens == alone and res.stats["slots"] == 3 and res.stats["new_tokens"] == sum(map(len, alone))
    assert "schedule" not in res.stats


@pytest.mark.parametrize("mode", ["parse", "sd", "sequential"])
def test_speculative_modes_serve_through_slots_equal_to_each_prompt_alone(mode):
    eng = _engine(rounds="single")  # (multi-round parse: tests/modes/test_parse_multi.py)
    served = eng.generate(PROMPTS[:5], mode=mode, max_new_tokens=10, max_batch=2)
    alone = [eng.generate([p], mode=mode, max_new_tokens=10) for p in PROMPTS[:5]]
    assert served.tokens == [r.tokens[0] for r in alone]
    assert served.stats["slots"] == 2 and served.stats["admissions"] >= 3
    assert served.stats["new_tokens"] == sum(r.stats["new_tokens"] for r in alone)
    assert served.stats["accepted_per_request"] == [a for r in alone for a in r.stats["accepted_per_request"]]


@pytest.mark.parametrize("mode", ["parse", "sd", "sequential"])
def test_auto_decodes_plainly_where_speculation_loses_and_speculates_where_it_wins(mode):
    eng = _engine(schedule="auto")
    eng._costs = costs(COMPUTE_BOUND, eagle3=False)  # a block costs its tokens in target steps
    plain = eng.generate(PROMPTS[:4], mode=mode, max_new_tokens=10)
    assert [c["ran"] for c in plain.stats["schedule"]] == ["target"]
    assert plain.tokens == generate(TARGET, PROMPTS[:4], max_new_tokens=10).tokens
    assert "verify_passes" not in plain.stats and plain.stats["mode"] == mode
    fixed = _engine().generate(PROMPTS[:1], mode=mode, max_new_tokens=10)
    eng = _engine(schedule="auto")
    eng._costs = costs(MEMORY_BOUND, eagle3=False)  # a 48-token block costs 2.4 steps
    spec = eng.generate(PROMPTS[:1], mode=mode, max_new_tokens=10)
    assert [c["ran"] for c in spec.stats["schedule"]] == [mode]
    assert spec.tokens == fixed.tokens  # the mode as configured, nothing else changed


def test_auto_keeps_explicit_settings_and_records_what_it_measured():
    eng = _engine(schedule="auto", max_prefixes=3, rounds="single")
    eng._costs = costs(MEMORY_BOUND, eagle3=False)
    first = eng.generate(PROMPTS, mode="parse", max_new_tokens=14, max_batch=4)
    # nothing measured at batch 4 yet: the predicted best runs on prompts of its own before anything is served; with
    # 7 prompts in 4 slots no fill is left over for a served exploration, so it is a fixed batch (no slots)
    assert first.stats["schedule"][0]["why"].startswith("exploring") and first.stats["schedule"][0]["slots"] is None
    # the user's rounds, never the schedule's choice, and each record names the rounds that ran (none: plain)
    assert all(c["rounds"] == ("single" if c["ran"] == "parse" else None) for c in first.stats["schedule"])
    second = eng.generate(PROMPTS, mode="parse", max_new_tokens=14, max_batch=4)  # (the first served run compiled)
    res = eng.generate(PROMPTS, mode="parse", max_new_tokens=14, max_batch=4)
    ran = first.stats["schedule"] + second.stats["schedule"] + res.stats["schedule"]
    assert ran[0]["ran"] == "parse"  # predicted to win
    # plain decoding only to measure it (more batches follow) or once both were measured, never from the prediction
    # alone, which favours PARSE on this table
    assert all(c["ran"] == "parse" or c["why"].startswith("exploring") or c["why"] == "measured" for c in ran)
    assert max(first.stats["prefixes_per_request"]) <= 3  # the user's max_prefixes, not the policy's search
    assert ("parse", 4) in eng.schedule_state.measured  # batches that compiled nothing are measurements
    assert res.stats["schedule"][0]["why"] in ("calibrated prediction", "measured", "exploring (not measured at this "
                                               "batch yet)")  # what earlier batches measured is used


def test_auto_is_the_default_and_serves_the_rest_through_slots():
    assert ParseConfig().schedule == "auto"
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(max_draft_tokens=12))
    eng._costs = costs(COMPUTE_BOUND, eagle3=False)  # plain decoding wins, and serves every prompt through 2 slots
    eng.schedule_state = _measured({"target": 0.1, "parse-multi": 0.3, "parse-single": 0.2}, 2)  # earlier calls
    res = eng.generate(PROMPTS, mode="parse", max_new_tokens=10, max_batch=2)
    assert [(c["ran"], c["why"]) for c in res.stats["schedule"]] == [("target", "measured")]
    assert res.stats["slots"] == 2 and res.stats["admissions"] > 1
    assert res.tokens == [generate(TARGET, [p], max_new_tokens=10).tokens[0] for p in PROMPTS]


def test_at_most_one_measuring_exploration_per_choice_and_call():
    """An explored batch that compiled measures nothing and may be explored again; a call measures at most once per
    choice (here two: plain decoding and parse with the user's rounds) by exploring, explores at most twice that
    many batches in all, then serves the rest. Plain decoding gets measured too, though parse is predicted ahead."""
    eng = _engine(schedule="auto", rounds="single")
    eng._costs = costs(MEMORY_BOUND, eagle3=False)
    for call in range(2):  # windows of at least EXPLORE_MIN_PROMPTS prompts
        res = eng.generate(PROMPTS * 3, mode="parse", max_new_tokens=6, max_batch=1)
        assert sum(c["why"].startswith("exploring") for c in res.stats["schedule"]) <= (4 if call == 0 else 2)
        assert not res.stats["schedule"][-1]["why"].startswith("exploring")
    assert {("parse", 1), ("target", 1)} <= set(eng.schedule_state.measured)


@pytest.mark.parametrize("slots", [1, 3])
def test_an_explored_choice_is_served_over_a_few_fills_of_its_slots(slots):
    """An explored choice runs through the programs the rest is then served with (so exploring compiles nothing the
    served run would not), over `EXPLORE_FILLS` x its slots of prompts (at least `EXPLORE_MIN_PROMPTS`: at one slot,
    3 prompts can all be ones the draft gets wrong), a finished row's slot taking the next one: it is measured as
    served, not by a fixed batch's slowest row. Each decision says how many prompts it ran and in how many slots;
    the rest is served."""
    prompts = PROMPTS * 4
    for _ in range(2):  # the second engine explores programs the first set up (an explored batch that compiles
        eng = _engine(schedule="auto", rounds="single")  # measures nothing and is explored again, using up prompts)
        eng._costs = costs(MEMORY_BOUND, eagle3=False)
        res = eng.generate(prompts, mode="parse", max_new_tokens=10, max_batch=slots)
    first, last = res.stats["schedule"][0], res.stats["schedule"][-1]
    window = max(EXPLORE_FILLS * slots, EXPLORE_MIN_PROMPTS)
    assert window == {1: EXPLORE_MIN_PROMPTS, 3: EXPLORE_FILLS * 3}[slots]
    assert first["why"].startswith("exploring") and (first["rows"], first["slots"]) == (window, slots)
    key = (first["ran"], bucket(slots, 1))
    assert key in eng.schedule_state.served and key not in eng.schedule_state.fixed_samples
    assert sum(c["rows"] for c in res.stats["schedule"]) == len(prompts)
    assert not last["why"].startswith("exploring") and last["rows"] > slots and last["slots"] == slots  # served
    start = 0  # each decision's prompts equal each prompt alone in what it ran (PARSE is lossy; the target is not)
    for c in res.stats["schedule"]:
        for i in range(start, start + c["rows"]):
            alone = (generate(TARGET, [prompts[i]], max_new_tokens=10) if c["ran"] == "target" else
                     _engine(rounds="single").generate([prompts[i]], mode="parse", max_new_tokens=10))
            assert res.tokens[i] == alone.tokens[0], (c, i)
        start += c["rows"]


def test_a_close_call_is_measured_again_only_where_the_work_left_pays_for_its_window(tmp_path, monkeypatch):
    """Plain decoding measured 30% behind parse (after the margin) is a close call, but measuring it again costs a
    window at its price: a fresh engine's call of 7 prompts at batch 1 (a window of 3, then 4 prompts) serves parse;
    in a long job, or in an engine that has already run many prompts (as many expected to come) outside a job, it
    measures plain decoding again first; a short job does not. Each engine starts from the same figures."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the setup file of this test: nothing to charge a job
    load_setup_costs(TARGET, DRAFT).with_figure("parse-single", 1, 0.0).with_figure("target", 1, 0.0).save()
    state = _measured({"parse": 0.1, "target": 0.13 / (1 - SPECULATION_MARGIN)}, 1)

    def engine(prompts_run=0):
        eng = _engine(schedule="auto", rounds="single")
        eng._costs, eng.schedule_state, eng._prompts_run = costs(MEMORY_BOUND, eagle3=False), state, prompts_run
        return eng

    short = engine().generate(PROMPTS, mode="parse", max_new_tokens=6, max_batch=1)
    assert [(c["ran"], c["why"]) for c in short.stats["schedule"]] == [("parse", "measured")]
    in_job = engine()
    with in_job.job(10**6):
        long = in_job.generate(PROMPTS, mode="parse", max_new_tokens=6, max_batch=1)
    busy = engine(prompts_run=10**6).generate(PROMPTS, mode="parse", max_new_tokens=6, max_batch=1)
    for res in (long, busy):
        first = res.stats["schedule"][0]
        assert first["ran"] == "target" and first["why"].startswith("exploring")
    one_off = engine(prompts_run=10**6)  # a one-off job expects its own prompts only, whatever the engine ran before
    with one_off.job(len(PROMPTS)):
        res = one_off.generate(PROMPTS, mode="parse", max_new_tokens=6, max_batch=1)
    assert [(c["ran"], c["why"]) for c in res.stats["schedule"]] == [("parse", "measured")]


def test_a_setup_figure_is_kept_under_the_rounds_its_programs_ran(tmp_path, monkeypatch):
    """An engine whose rounds are set (bench's `parse` is single round) keeps its setup figure under the name an
    engine with rounds="auto" looks up for the same programs (`parse-single`), so one command's figure is another's
    (a new process's ledger reads it from the file)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    explicit = _engine(schedule="auto", rounds="single")
    explicit._costs = costs(MEMORY_BOUND, eagle3=False)  # parse predicted to win
    with explicit.job(10**9):  # long enough to pay an unmeasured setup
        res = explicit.generate(PROMPTS, mode="parse", max_new_tokens=6, max_batch=2)
    assert "parse" in {c["ran"] for c in res.stats["schedule"]}
    kept = load_setup_costs(TARGET, DRAFT)
    names = set(kept.seconds) | set(kept.warm)
    assert not any(n.startswith("parse@") for n in names)
    if "parse-single@2" not in names:  # its programs were ready in this process (another test ran those shapes)
        assert ("parse-single", 2) in ledger(kept).ready
        return
    _LEDGERS.clear()  # a new process: what it expects is read from the file
    auto = _engine(schedule="auto", rounds="auto")
    with auto.job(4):
        charge = auto._charge("parse", ("multi", "single"), 2, 6, 0).seconds
    assert charge["parse-multi"] == UNMEASURED_SECONDS  # never set up: the prior
    assert charge["parse-single"] == pytest.approx(kept.expected("parse-single", 2))


@pytest.mark.parametrize("faster", ["multi", "single"])
def test_rounds_auto_runs_the_rounds_measured_faster_as_that_fixed_setting_would(faster):
    """`rounds="auto"` (the default) lets the schedule choose multi or single round per batch; what a batch ran
    equals the engine with that rounds fixed."""
    assert ParseConfig().rounds == "auto"
    eng = _engine(schedule="auto", rounds="auto")
    eng._costs = costs(MEMORY_BOUND, eagle3=False)
    slower = {"multi": "single", "single": "multi"}[faster]
    eng.schedule_state = _measured({f"parse-{faster}": 0.1, f"parse-{slower}": 0.5, "target": 0.4}, 2)
    res = eng.generate(PROMPTS[:4], mode="parse", max_new_tokens=12, max_batch=2)
    assert [(c["ran"], c["rounds"], c["why"]) for c in res.stats["schedule"]] == [("parse", faster, "measured")]
    fixed = _engine(rounds=faster).generate(PROMPTS[:4], mode="parse", max_new_tokens=12, max_batch=2)
    assert res.tokens == fixed.tokens
    assert res.stats["accepted_per_request"] == fixed.stats["accepted_per_request"]


def test_in_one_slot_rounds_auto_runs_parse_multi_round_whatever_single_round_measured():
    """In one slot, where nothing waits for a row's rounds, parse's later rounds replace the plain decoding its
    single round ends in: `rounds="auto"` runs multi-round there even where single-round measured far ahead (at one
    row a window of a few prompts says which prompts it held, not which rounds are faster). In two slots the
    measured figures decide (above); the user's rounds are honoured."""
    eng = _engine(schedule="auto", rounds="auto")
    eng._costs = costs(MEMORY_BOUND, eagle3=False)
    state = eng.schedule_state = _measured({"parse-single": 0.1, "parse-multi": 0.5, "target": 2.0}, 1)
    res = eng.generate(PROMPTS, mode="parse", max_new_tokens=12, max_batch=1)
    assert [(c["ran"], c["rounds"]) for c in res.stats["schedule"]] == [("parse", "multi")]
    assert set(res.stats["schedule"][0]["seconds_per_token"]) == {"parse-multi", "target"}
    assert res.tokens == _engine(rounds="multi").generate(PROMPTS, mode="parse", max_new_tokens=12,
                                                          max_batch=1).tokens
    single = _engine(schedule="auto", rounds="single")
    single._costs, single.schedule_state = eng._costs, state
    res = single.generate(PROMPTS[:2], mode="parse", max_new_tokens=12, max_batch=1)
    assert all(c["rounds"] == ("single" if c["ran"] == "parse" else None) for c in res.stats["schedule"])
    assert res.tokens == _engine(rounds="single").generate(PROMPTS[:2], mode="parse", max_new_tokens=12,
                                                           max_batch=1).tokens


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4"])
def test_max_batch_must_be_a_positive_integer(bad):
    with pytest.raises(InputError, match="max_batch"):
        _engine().generate(PROMPTS, mode="target", max_new_tokens=4, max_batch=bad)


def test_a_job_decodes_plainly_where_the_mode_s_setup_would_not_pay_back(tmp_path, monkeypatch):
    """`engine.job(n)`: each choice's program setup, as earlier runs measured it (a file beside the profiles), is
    charged to the job's rows. A job whose rows cannot pay back sd's setup runs plain decoding (the target's tokens)
    and explores nothing; the same engine outside a job speculates where the costs say it wins. With no figure on
    record, a short job does not pay an unmeasured setup and a long one does, and leaves its figure in the file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the profiles folder (and the setup file) of this test
    eng = _engine(schedule="auto")
    eng._costs = costs(MEMORY_BOUND, eagle3=False)  # sd predicted to win
    load_setup_costs(TARGET, DRAFT).with_figure("sd", 2, 1e6).with_figure("target", 2, 0.0).save()
    with eng.job(6):
        res = eng.generate(PROMPTS[:6], mode="sd", max_new_tokens=10, max_batch=2)
    assert {c["ran"] for c in res.stats["schedule"]} == {"target"}
    assert res.stats["schedule"][0]["setup_seconds_per_token"]["sd"] > 1e3
    assert res.tokens == generate(TARGET, PROMPTS[:6], max_new_tokens=10).tokens
    written = load_setup_costs(TARGET, DRAFT).seconds
    assert written["sd@2"] == 1e6 and set(written) <= {"sd@2", "target@2"}
    free = eng.generate(PROMPTS[:6], mode="sd", max_new_tokens=10, max_batch=2)  # no job: setup not charged
    assert "sd" in {c["ran"] for c in free.stats["schedule"]}  # explored: sd measured on this machine
    assert all(c["setup_seconds_per_token"] == {} for c in free.stats["schedule"])
    fresh = _engine(schedule="auto")
    fresh._costs = costs(MEMORY_BOUND, eagle3=False)
    # no figure for sd at batch 4: expected to cost UNMEASURED_SECONDS, more than 4 prompts pay back (one batch of 4:
    # a batch of 2 would meet bucket 2, where `eng` above may have made sd ready in this process)
    with fresh.job(4):
        short = fresh.generate(PROMPTS[:4], mode="sd", max_new_tokens=10, max_batch=4)
    assert {c["ran"] for c in short.stats["schedule"]} == {"target"}
    charged = short.stats["schedule"][0]["setup_seconds_per_token"]
    assert set(charged) == {"sd"} and charged["sd"] > 1e-2  # plain decoding is never charged an unmeasured setup
    assert "sd@4" not in load_setup_costs(TARGET, DRAFT).seconds
    # another test in this worker may have set sd@4's programs up, and a run that sets nothing up pays nothing, so
    # writes no figure
    _forget_programs()
    with fresh.job(10**9):  # a job long enough to pay it back: sd runs, and what its setup took is written down
        ran = fresh.generate(PROMPTS[:6], mode="sd", max_new_tokens=10, max_batch=4)
    assert "sd" in {c["ran"] for c in ran.stats["schedule"]}
    # paid for compiling (the figure paid), or, its programs in the suite's compile cache, for loading (the warm one)
    after = load_setup_costs(TARGET, DRAFT)
    assert "sd@4" in {**after.seconds, **after.warm} and ("sd@4" in after.seconds or after.cache_on)
    assert after.expected("sd", 4) == (after.get_warm("sd", 4) if "sd@4" in after.warm else after.get("sd", 4))
    with pytest.raises(InputError, match="prompts must be"):
        with eng.job(0):
            pass


def _forget_programs() -> None:
    """What a new process holds in memory: no program set up (the persistent caches keep theirs)."""
    jax.clear_caches()
    for program in _PROGRAMS:
        program._ready.clear()


def test_a_long_job_on_a_new_machine_leaves_a_warm_figure_estimated_from_its_loads(tmp_path, monkeypatch):
    """No figures on record, empty caches: one process decodes plainly (its programs compiled and stored in the
    executable cache); the next one decodes plainly too (as an eval's first window does: it loads them), then its
    long job explores sd and compiles it. Its loads timed loading against setting up, so it leaves sd a warm figure,
    estimated from its setup and under the figure paid, where the next process with the cache on expects it
    (without timed loads there was none, and a short job was charged the figure paid)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(programs, "_SETUP", [programs.SetupSplit()])  # a new process's setup totals: none
    with executables.using(tmp_path / "executables"):
        _forget_programs()
        plain = _engine(schedule="auto").generate(PROMPTS[:6], mode="target", max_new_tokens=10, max_batch=4)
        _forget_programs()
        before = setup_split()
        assert _engine(schedule="auto").generate(PROMPTS[:6], mode="target", max_new_tokens=10,
                                                 max_batch=4).tokens == plain.tokens
        eng = _engine(schedule="auto")
        eng._costs = costs(MEMORY_BOUND, eagle3=False)  # sd predicted to win
        with eng.job(10**9):
            ran = eng.generate(PROMPTS[:6], mode="sd", max_new_tokens=10, max_batch=4)
        paid = setup_split() - before
        after = load_setup_costs(TARGET, DRAFT)
    assert "sd" in {c["ran"] for c in ran.stats["schedule"]} and ran.tokens == plain.tokens
    assert paid.stored > 0 and paid.stored_set_up > 0 and paid.stored_loads > 0  # compiled some, loaded some
    assert after.cache_on  # the executable cache (with or without jax's)
    figure, warm = after.get("sd", 4), after.get_warm("sd", 4)
    assert figure is not None and warm is not None and 0 < warm < figure
    assert after.expected("sd", 4) == warm


def test_the_schedule_expects_a_row_to_write_what_rows_have_written_not_the_budget(tmp_path, monkeypatch):
    """Answers end long before the budget (the embedded task's about 21 tokens of 256): priced at the budget, a
    single round that drafts the whole answer looked no faster than plain decoding. Each decision after the first
    batch expects a row to write the mean of what rows wrote (each batch half the figure), capped at the budget; a
    job's setup charge spreads over its rows x that figure / the rows at once."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the setup file of this test's job
    seen = []
    monkeypatch.setattr("parse_jax.engine.choose", lambda *a, **k: seen.append(k) or choose(*a, **k))
    eng = _engine(schedule="auto", rounds="single")
    eng._costs = costs(MEMORY_BOUND, eagle3=False)
    written = [t for row in generate(TARGET, PROMPTS[:6], max_new_tokens=48).tokens for t in row]
    stop = max(set(written), key=written.count)  # the tiny model's commonest token ends its answers early
    with eng.job(6):
        calls = [eng.generate(PROMPTS[i:i + 2], mode="parse", max_new_tokens=48, eos_ids=[stop]) for i in (0, 2, 4)]
    means = [sum(map(len, r.tokens)) / len(r.tokens) for r in calls]
    assert max(means) < 48
    expected = [48, max(1, round(means[0])), max(1, round(0.5 * means[1] + 0.5 * means[0]))]
    assert [k["workload"].remaining_tokens for k in seen] == expected
    assert [k["outlook"].charge.steps for k in seen] == [rows * e / 2 for rows, e in zip((6, 4, 2), expected)]


def test_rounds_auto_runs_a_request_only_single_round_fits_single_round():
    """Multi round's draft follows the whole output; single round's drafts one answer of `max_draft_tokens`. Where a
    prompt's budget fits the draft's positions only in single round, `rounds="auto"` runs single round instead of
    refusing the request; rounds pinned to multi (or a fixed schedule, which runs the resolved rounds) still refuse it
    in one line."""
    short = Model(dataclasses.replace(DRAFT.config, max_position_embeddings=40), DRAFT.params, DRAFT.tokenizer)
    prompt, budget = PROMPTS[0], 28  # 13 prompt tokens: single round needs 13 + 12, multi round 13 + 29 (> 40)

    def engine(**kw):
        return ParseEngine(TARGET, short, ParseConfig(**{"max_draft_tokens": 12, **kw}))

    auto = engine(rounds="auto", schedule="auto")
    auto._costs = costs(MEMORY_BOUND, eagle3=False)  # speculation wins
    res = auto.generate([prompt] * 3, mode="parse", max_new_tokens=budget, max_batch=1)
    assert {(c["ran"], c["rounds"]) for c in res.stats["schedule"]} == {("parse", "single")}
    assert res.tokens == engine(rounds="single", schedule="fixed").generate(
        [prompt] * 3, mode="parse", max_new_tokens=budget).tokens
    for kw in ({"rounds": "multi", "schedule": "auto"}, {"rounds": "auto", "schedule": "fixed"}):
        with pytest.raises(InputError, match="positions .* in the draft, which holds 40"):
            engine(**kw).generate([prompt], mode="parse", max_new_tokens=budget)
