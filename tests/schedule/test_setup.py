"""Program setup per (choice, batch bucket): a process's total is the figure, averaged with the figure it found on
record; a job is charged what is left of the figure found, a speculative choice never measured an expected setup,
and a choice nothing once a batch of it set nothing up."""

import pytest

from parse_jax.schedule.setup import EMA, UNMEASURED_SECONDS, SetupCosts, SetupLedger, ledger


def test_a_process_total_is_averaged_with_the_figure_it_found():
    costs = SetupCosts().with_total("parse-single", 8, 5.0, None)
    assert costs.get("parse-single", 8) == 5.0 and costs.get("parse-single", 4) is None
    assert costs.with_total("parse-single", 8, 30.0, 14.9).get("parse-single", 8) == pytest.approx(
        EMA * 30.0 + (1 - EMA) * 14.9)
    # with_figure: one measurement averaged with the figure on record; other keys untouched
    two = costs.with_figure("target", 8, 1.0).with_figure("parse-single", 8, 7.0)
    assert two.get("parse-single", 8) == pytest.approx(EMA * 7.0 + (1 - EMA) * 5.0) and two.get("target", 8) == 1.0


def test_a_setup_paid_in_parts_is_charged_what_is_left_and_recorded_whole():
    book = SetupLedger()
    none = SetupCosts()
    # nothing on record: a speculative choice is expected to cost UNMEASURED_SECONDS; plain decoding nothing
    assert book.left(none, "parse-single", 8, speculative=True) == UNMEASURED_SECONDS
    assert book.left(none, "target", 8, speculative=False) is None
    costs = book.pay(none, "parse-single", 8, 6.0, speculative=True)
    assert book.left(costs, "parse-single", 8, speculative=True) == pytest.approx(UNMEASURED_SECONDS - 6.0)
    # one partial payment is no full figure: averaged with the prior, not written as 6 s
    assert costs.get("parse-single", 8) == pytest.approx(EMA * 6.0 + (1 - EMA) * UNMEASURED_SECONDS)
    costs = book.pay(costs, "parse-single", 8, 9.0, speculative=True)  # a later run met new shapes: 9 s more
    assert costs.get("parse-single", 8) == pytest.approx(EMA * 15.0 + (1 - EMA) * UNMEASURED_SECONDS)  # the total
    assert book.left(costs, "parse-single", 8, speculative=True) == 0.0  # paid more than expected: nothing left
    assert book.left(costs, "parse-multi", 8, speculative=True) == UNMEASURED_SECONDS  # keys are apart
    assert book.left(costs, "parse-single", 4, speculative=True) == UNMEASURED_SECONDS
    # the next process finds 12.5 s on record: charged whole, then what is left of it (not of a figure its own
    # payments have averaged in)
    later = SetupLedger()
    assert later.left(costs, "parse-single", 8, speculative=True) == pytest.approx(12.5)
    after = later.pay(costs, "parse-single", 8, 4.0, speculative=True)
    assert after.get("parse-single", 8) == pytest.approx(EMA * 4.0 + (1 - EMA) * 12.5)
    assert later.left(after, "parse-single", 8, speculative=True) == pytest.approx(8.5)
    # a run of it that set nothing up: ready, charged nothing more
    later.ready.add(("parse-single", 8))
    assert later.left(after, "parse-single", 8, speculative=True) is None


def test_engines_of_one_process_share_the_ledger_of_their_setup_file(tmp_path):
    a = SetupCosts(path=tmp_path / "a.json")
    assert ledger(a) is ledger(SetupCosts(path=tmp_path / "a.json")) is not ledger(SetupCosts(path=tmp_path / "b.json"))
