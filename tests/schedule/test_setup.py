"""Program setup per (choice, batch bucket): a process's total is the figure, averaged with the earlier processes'
figure; a job is charged what is left of it, and a speculative choice never measured an expected setup."""

import types

import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.schedule.auto import ScheduleChoice
from parse_jax.schedule.setup import EMA, UNMEASURED_SECONDS, SetupCosts, load_setup_costs
from tests.test_engine import DRAFT, TARGET


def test_a_process_total_replaces_its_own_earlier_parts_and_averages_with_the_figure_before_it():
    costs = SetupCosts()
    assert costs.with_total("parse-single", 8, 5.0, None).get("parse-single", 8) == 5.0
    first = costs.with_total("parse-single", 8, 5.0, None)
    # the same process paid 9.9 more: its total is 14.9, not an average of its two parts
    assert first.with_total("parse-single", 8, 14.9, None).get("parse-single", 8) == pytest.approx(14.9)
    # a later process's total, averaged with the figure before it paid any
    assert first.with_total("parse-single", 8, 30.0, 14.9).get("parse-single", 8) == pytest.approx(
        EMA * 30.0 + (1 - EMA) * 14.9)
    # with_figure: one measurement averaged with the figure on record; other keys untouched
    two = first.with_figure("target", 8, 1.0).with_figure("parse-single", 8, 7.0)
    assert two.get("parse-single", 8) == pytest.approx(EMA * 7.0 + (1 - EMA) * 5.0) and two.get("target", 8) == 1.0
    assert two.get("parse-single", 4) is None


def _ran(engine, name: str, rows: int, tokens: int, seconds: float, estimate: float = 0.0) -> None:
    """The engine's record of a run of `name` over `rows` rows (each writing `tokens`) that set up programs."""
    run, _, rounds = name.partition("-")
    choice = ScheduleChoice(run, "parse", rows, {name: estimate}, {name: estimate}, {}, rounds=rounds or None)
    engine._record_setup(choice, types.SimpleNamespace(tokens=[[1] * tokens] * rows), rows, seconds)


def test_a_job_is_charged_what_is_left_of_a_setup_paid_in_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the profiles folder (and the setup file) of this test
    eng = ParseEngine(TARGET, DRAFT, ParseConfig())
    eng._row_tokens = 10.0
    with eng.job(80):
        steps = 80 * 10.0 / 8  # the job's rows x tokens per row / rows at once
        charge = eng._charge("parse", ("multi", "single"), 8, 16, 0)
        # nothing on record: each speculative choice is expected to cost UNMEASURED_SECONDS; plain decoding nothing
        assert charge.seconds == {"parse-multi": UNMEASURED_SECONDS, "parse-single": UNMEASURED_SECONDS}
        assert charge.per_token("parse-single") == pytest.approx(UNMEASURED_SECONDS / steps)
        _ran(eng, "parse-single", 8, 10, 6.0, estimate=0.01)  # 6 s for 10 steps at 10 ms: 5.9 s of setup
        assert eng._setup.get("parse-single", 8) == pytest.approx(5.9)
        # still expected to cost UNMEASURED_SECONDS in all (nothing was on record): the rest is charged
        assert eng._charge("parse", ("single",), 8, 16, 0).seconds["parse-single"] == pytest.approx(
            UNMEASURED_SECONDS - 5.9)
        _ran(eng, "parse-single", 8, 10, 9.0)  # a later run met new shapes: 9 s more
        assert eng._setup.get("parse-single", 8) == pytest.approx(14.9)  # the total, not an average of the parts
        eng._setup.save()
        left = eng._charge("parse", ("multi", "single"), 8, 16, 0).seconds  # paid more than expected: nothing left
        assert left["parse-single"] == pytest.approx(0.0) and left["parse-multi"] == UNMEASURED_SECONDS
    # the next process: the figure on record is charged whole, and its own total is averaged with it
    fresh = ParseEngine(TARGET, DRAFT, ParseConfig())
    assert load_setup_costs(TARGET, DRAFT).get("parse-single", 8) == pytest.approx(14.9)
    with fresh.job(80):
        assert fresh._charge("parse", ("single",), 8, 16, 0).seconds == {"parse-single": pytest.approx(14.9)}
        _ran(fresh, "parse-single", 8, 10, 4.0)  # what is left of the figure it found, not of one averaged with 4 s
        assert fresh._charge("parse", ("single",), 8, 16, 0).seconds["parse-single"] == pytest.approx(10.9)
        _ran(fresh, "parse-single", 8, 10, 4.0)
        assert fresh._setup.get("parse-single", 8) == pytest.approx(EMA * 8.0 + (1 - EMA) * 14.9)
