"""Program setup per (choice, batch bucket): a process's total is the figure, averaged with the figure it found on
record (the first one taken as it is); a job is charged what is left of the figure found, a speculative choice
never measured an expected setup, and a choice nothing once a batch of it set nothing up."""

import dataclasses
import json

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
    costs = book.pay(none, "parse-single", 8, 6.0)
    assert book.left(costs, "parse-single", 8, speculative=True) == pytest.approx(UNMEASURED_SECONDS - 6.0)
    # the first measurement is the figure: the prior is no measurement to average with
    assert costs.get("parse-single", 8) == pytest.approx(6.0)
    costs = book.pay(costs, "parse-single", 8, 9.0)  # a later run met new shapes: 9 s more
    assert costs.get("parse-single", 8) == pytest.approx(15.0)  # the total
    assert book.left(costs, "parse-single", 8, speculative=True) == 0.0  # paid more than expected: nothing left
    assert book.left(costs, "parse-multi", 8, speculative=True) == UNMEASURED_SECONDS  # keys are apart
    assert book.left(costs, "parse-single", 4, speculative=True) == UNMEASURED_SECONDS
    # the next process finds 15 s on record: charged whole, then what is left of it (not of a figure its own
    # payments have averaged in)
    later = SetupLedger()
    assert later.left(costs, "parse-single", 8, speculative=True) == pytest.approx(15.0)
    after = later.pay(costs, "parse-single", 8, 4.0)
    assert after.get("parse-single", 8) == pytest.approx(EMA * 4.0 + (1 - EMA) * 15.0)
    assert later.left(after, "parse-single", 8, speculative=True) == pytest.approx(11.0)
    # a run of it that set nothing up: ready, charged nothing more
    later.ready.add(("parse-single", 8))
    assert later.left(after, "parse-single", 8, speculative=True) is None


def test_engines_of_one_process_share_the_ledger_of_their_setup_file(tmp_path):
    a = SetupCosts(path=tmp_path / "a.json")
    assert ledger(a) is ledger(SetupCosts(path=tmp_path / "a.json")) is not ledger(SetupCosts(path=tmp_path / "b.json"))


def test_where_the_compile_cache_is_on_the_warm_figure_is_expected_and_recorded(tmp_path):
    """A process that compiled a choice's programs put them into the compile cache: the next one expects what
    loading them costs (the warm figure), measured or estimated; without a compile cache, the figure paid."""
    cold = SetupCosts(path=tmp_path / "s.json", cache_on=False)
    costs = SetupLedger().pay(cold, "parse-single", 8, 36.0, warm=None)  # no cache: no twin
    assert costs.get_warm("parse-single", 8) is None and costs.expected("parse-single", 8) == costs.get(
        "parse-single", 8)
    book = SetupLedger()
    costs = book.pay(dataclasses.replace(cold, cache_on=True), "parse-single", 8, 36.0, warm=6.0)
    assert costs.get("parse-single", 8) == pytest.approx(36.0)  # first measurements, as they are
    assert costs.get_warm("parse-single", 8) == pytest.approx(6.0)
    costs = book.pay(costs, "parse-single", 8, 2.0, warm=1.0)  # new shapes: the totals grow
    warm = 7.0
    assert costs.get_warm("parse-single", 8) == pytest.approx(warm) and costs.get("parse-single", 8) == 38.0
    # the next process with the cache on expects the warm figure, and is charged it; one without, the one paid
    assert SetupLedger().left(costs, "parse-single", 8, speculative=True) == pytest.approx(warm)
    off = dataclasses.replace(costs, cache_on=False)
    assert SetupLedger().left(off, "parse-single", 8, speculative=True) == pytest.approx(costs.get("parse-single", 8))
    # a process that loaded every program: its seconds are the warm figure's, and leave the figure paid alone
    later = SetupLedger()
    after = later.pay(costs, "parse-single", 8, 5.0, warm=5.0, compiled=False)
    assert after.get_warm("parse-single", 8) == pytest.approx(EMA * 5.0 + (1 - EMA) * warm)
    assert after.get("parse-single", 8) == costs.get("parse-single", 8)
    assert later.left(after, "parse-single", 8, speculative=True) == pytest.approx(warm - 5.0)
    after.save()
    stored = json.loads((tmp_path / "s.json").read_text())
    assert stored["warm_seconds"] == {"parse-single@8": after.get_warm("parse-single", 8)}


def test_a_compiled_setup_is_scaled_to_what_loading_it_costs():
    from parse_jax.runtime.programs import SetupSplit

    paid = SetupSplit(events=3, seconds=20.0, compiled=16.0)
    process = SetupSplit(events=9, seconds=30.0, compiled=16.0, loaded=3.5, timed_loads=3.0, timed_compiles=12.0)
    assert paid.warm(process) == pytest.approx(20.0 - 16.0 * 0.75)  # loading: a quarter of compiling
    loaded = SetupSplit(seconds=5.0, compiled=0.2, loaded=4.0)
    assert loaded.loaded_all and loaded.warm(process) == 5.0  # all loaded: what it paid
    assert paid.warm(SetupSplit(seconds=20.0, compiled=16.0)) is None  # nothing timed yet: nothing to scale by
    # the executable cache's programs: a load replaces their tracing and lowering too, scaled by its own loads
    # (0.5 s against 10 s set up); jax's compiling outside it (16 - 9 s) by jax's loads, else by the same ratio
    exe = SetupSplit(events=3, seconds=20.0, compiled=16.0, stored=12.0, stored_compiled=9.0)
    timed = SetupSplit(stored_loads=0.5, stored_set_up=10.0)
    assert exe.warm(timed) == pytest.approx(20.0 - 12.0 * 0.95 - 7.0 * 0.95)
    both = dataclasses.replace(timed, timed_loads=3.0, timed_compiles=12.0)
    assert exe.warm(both) == pytest.approx(20.0 - 12.0 * 0.95 - 7.0 * 0.75)
    assert exe.warm(process) == pytest.approx(20.0 - 12.0 * 0.75 - 7.0 * 0.75)  # no executable loads: jax's ratio
    assert (process - paid) == SetupSplit(events=6, seconds=10.0, compiled=0.0, loaded=3.5, timed_loads=3.0,
                                          timed_compiles=12.0)


def test_jax_s_setup_events_are_split_into_compiled_and_loaded():
    """The listener reads jax's events as jax 0.10 sends them: a load reports the compile seconds it saved (the
    stored whole seconds less its retrieval), then its retrieval, then the backend's duration around it."""
    from parse_jax.runtime import programs

    saved = programs._SETUP[0]
    try:
        programs._SETUP[0] = programs.SetupSplit()
        for event, seconds in ((programs._SAVED, 2.7), (programs._LOADED, 0.3), (programs._BACKEND, 0.35),
                               (programs._SAVED, -0.01), (programs._LOADED, 0.01), (programs._BACKEND, 0.02),
                               ("/jax/core/compile/jaxpr_trace_duration", 1.0), (programs._BACKEND, 4.0)):
            programs._count_setup(event, seconds)
        split = programs.setup_split()
        assert split.events == 4 and split.seconds == pytest.approx(5.37)
        assert split.loaded == pytest.approx(0.31) and split.compiled == pytest.approx(4.06)
        # only the load whose compiling jax recorded (3 s) times loading against compiling
        assert split.timed_loads == pytest.approx(0.3) and split.timed_compiles == pytest.approx(3.5)
    finally:
        programs._SETUP[0] = saved


def test_the_executable_cache_s_events_time_its_loads_against_its_compiles():
    """A compile for the executable cache is reported between a start mark and its wall seconds (0: not stored),
    jax's own events of it counted as they come between them: what it stored is the setup jax reported there (a
    compile inside it is its own); a load reports the seconds its executable took to set up where it was stored,
    then its own."""
    from parse_jax.runtime import executables, programs

    saved = programs._SETUP[0]
    try:
        programs._SETUP[0] = programs.SetupSplit()
        trace = "/jax/core/compile/jaxpr_trace_duration"
        for event, seconds in ((programs._BACKEND, 1.0), (executables.COMPILE_START_EVENT, 0.0), (trace, 0.5),
                               (executables.COMPILE_START_EVENT, 0.0), (programs._BACKEND, 0.25),
                               (executables.COMPILE_EVENT, 0.3), (programs._BACKEND, 2.0),
                               (executables.COMPILE_EVENT, 2.9),  # wall seconds: more than jax reported
                               (executables.COMPILE_START_EVENT, 0.0), (programs._BACKEND, 0.5),
                               (executables.COMPILE_EVENT, 0.0),  # not stored: nothing a load would save
                               (executables.LOAD_SAVED_EVENT, 3.0), (executables.LOAD_EVENT, 0.2),
                               (executables.LOAD_EVENT, 0.1)):
            programs._count_setup(event, seconds)
        split = programs.setup_split()
        assert split.events == 7 and split.seconds == pytest.approx(4.55) and split.compiled == pytest.approx(3.75)
        assert split.stored == pytest.approx(2.75) and split.stored_compiled == pytest.approx(2.25)
        assert split.loaded == pytest.approx(0.3) and programs._COMPILE_MARKS == []
        # only the load whose setup seconds came before it times loading against setting up
        assert split.stored_loads == pytest.approx(0.2) and split.stored_set_up == pytest.approx(3.0)
    finally:
        programs._SETUP[0] = saved


def test_warm_figures_are_read_back_with_the_models_fingerprint(tmp_path):
    from parse_jax.runtime import executables
    from parse_jax.schedule.setup import load_setup_costs
    from parse_jax.utils import compile_cache
    from tests.random_models import random_model

    target = random_model("llama3", 5)
    costs = load_setup_costs(target, folder=tmp_path)
    assert costs.warm == {} and costs.cache_on == (compile_cache.active() or executables.folder() is not None)
    costs.with_total("parse-single", 4, 9.0, None).with_warm("parse-single", 4, 2.5, None).save()
    again = load_setup_costs(target, folder=tmp_path)
    assert again.get("parse-single", 4) == 9.0 and again.get_warm("parse-single", 4) == 2.5


def test_setup_figures_outlive_a_change_of_what_a_profile_times(monkeypatch):
    """The setup key is the models, device and versions: a new profile grid or file format keeps the figures."""
    from parse_jax.schedule import profile, setup
    from parse_jax.schedule.profile import Grid as profile_grid
    from tests.random_models import random_model

    target, draft = random_model("llama3", 5), random_model("qwen3", 6)
    key, before = setup.setup_key(target, draft), profile.fingerprint(target, profile.Grid())
    monkeypatch.setattr(profile, "Grid", lambda: profile_grid(batches=(1, 2), tokens=(1, 4), caches=(16,)))
    monkeypatch.setattr(profile, "FORMAT", profile.FORMAT + 1)
    assert profile.fingerprint(target, profile.Grid()) != before
    assert setup.setup_key(target, draft) == key
    assert setup.setup_key(random_model("llama3", intermediate_size=64), draft) != key  # another target


def test_figures_of_an_earlier_format_are_not_read(tmp_path, monkeypatch):
    """A figure whose meaning changed (format 1 averaged a process's first figure with the prior) is set aside: a
    process with the current format starts from nothing, and measures again."""
    from parse_jax.schedule import setup
    from tests.random_models import random_model

    assert setup.FORMAT >= 2  # format 1's figures were averaged with the prior
    target = random_model("llama3", 5)
    monkeypatch.setattr(setup, "FORMAT", setup.FORMAT - 1)
    setup.load_setup_costs(target, folder=tmp_path).with_total("parse-single", 8, 11.1, None).save()
    assert setup.load_setup_costs(target, folder=tmp_path).get("parse-single", 8) == 11.1
    monkeypatch.undo()
    assert setup.load_setup_costs(target, folder=tmp_path).get("parse-single", 8) is None
