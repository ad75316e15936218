"""The profile: measured tables cached on disk, keyed by the model's fingerprint, never required."""

import json

import jax
import pytest

import parse_jax
from parse_jax.schedule import profile
from parse_jax.schedule.costs import CostTable, Roofline
from parse_jax.schedule.profile import Grid, load_or_profile, pass_costs
from tests.fake_devices import run_on_devices
from tests.random_models import random_model

TINY = Grid(batches=(1, 2), tokens=(1, 4), caches=(16,), max_block_tokens=4, repeats=1, rounds=1)


@pytest.fixture(scope="module")
def model():
    return random_model("llama3")


def test_profile_round_trips_through_the_cache(model, tmp_path):
    assert load_or_profile(model, grid=TINY, folder=tmp_path) is None  # none yet, and none measured
    assert list(tmp_path.iterdir()) == []
    table = load_or_profile(model, measure=True, grid=TINY, folder=tmp_path)
    assert isinstance(table, CostTable) and (table.batches, table.tokens, table.caches) == ((1, 2), (1, 4), (16,))
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["fingerprint"]["config"] == model.config.to_dict()
    assert load_or_profile(model, grid=TINY, folder=tmp_path) == table  # read back, not measured again
    # batch 2 x 4 tokens is past max_block_tokens: filled in proportion to tokens, and marked as not timed
    assert table.measured[1][1] == (False,) and table.measured[0][1] == (True,)
    assert table.seconds(2, 4, 16) == pytest.approx(4 * table.seconds(2, 1, 16))
    assert all(x > 0 for p in table.seconds_grid for r in p for x in r)


def test_profile_is_invalidated_when_the_fingerprint_changes(model, tmp_path, monkeypatch):
    load_or_profile(model, measure=True, grid=TINY, folder=tmp_path)
    other = random_model("llama3", intermediate_size=64)
    assert load_or_profile(other, grid=TINY, folder=tmp_path) is None  # another model
    assert load_or_profile(model, grid=Grid(batches=(1,), tokens=(1,), caches=(16,), repeats=1),
                           folder=tmp_path) is None  # another grid
    path = profile.profile_path(profile.fingerprint(model, TINY), tmp_path)
    stored = json.loads(path.read_text())
    monkeypatch.setattr(profile, "package_version", lambda: "999.0")  # a new release of the library
    assert load_or_profile(model, grid=TINY, folder=tmp_path) is None
    monkeypatch.undo()
    if jax.devices()[0].platform == "cpu":  # another processor (jax names every CPU "cpu")
        monkeypatch.setattr(profile, "cpu_identity", lambda: {"cpu_model": "x", "cpu_flags": "0", "cpu_count": 2})
        assert load_or_profile(model, grid=TINY, folder=tmp_path) is None
        monkeypatch.undo()
    stored["fingerprint"]["device_count"] += 1  # a file whose stored fingerprint differs is never used
    path.write_text(json.dumps(stored))
    assert load_or_profile(model, grid=TINY, folder=tmp_path) is None
    path.write_text("{not json")
    assert load_or_profile(model, grid=TINY, folder=tmp_path) is None


MESH_KEYS = """
import json, sys
import parse_jax as pj
from parse_jax.checkpoints.orbax import save_model
from parse_jax.schedule.profile import model_fingerprint
from tests.random_models import random_model
save_model(random_model("qwen3", seed=3), sys.argv[1] + "/m")
out = {}
for mesh in (None, "data=4", "data=2,model=2"):
    m = pj.load_model(sys.argv[1] + "/m", mesh=None if mesh is None else pj.make_mesh(mesh))
    out[str(mesh)] = json.dumps(model_fingerprint(m), sort_keys=True)
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_a_profile_is_keyed_by_the_mesh_it_was_timed_on(tmp_path):
    """A pass split over a mesh costs what its layout makes it cost: a table timed unsharded (or on another mesh) is
    not served to a run on a mesh (it was: the key held the device count only). On 4 fake CPU devices."""
    keys = run_on_devices(MESH_KEYS, str(tmp_path))
    assert len(set(keys.values())) == 3
    assert "mesh" not in json.loads(keys["None"])  # unsharded models keep the key they had (their tables stay valid)


def test_pass_costs_fall_back_to_the_roofline(model, tmp_path):
    draft = random_model("qwen3")
    costs = pass_costs(model, draft, folder=tmp_path, grid=TINY, drafter_grid=TINY)
    assert costs.sources == {"target": "roofline", "draft": "roofline"} and isinstance(costs.target, Roofline)
    load_or_profile(draft, measure=True, grid=TINY, folder=tmp_path)
    again = pass_costs(model, draft, folder=tmp_path, grid=TINY, drafter_grid=TINY)
    assert again.sources == {"target": "roofline", "draft": "profile"}


def test_profiles_live_beside_the_compile_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profile.profiles_dir() == tmp_path / "parse-jax" / "profiles"


def test_grid_refuses_bad_axes():
    with pytest.raises(parse_jax.ConfigError, match="profile grid batches must be strictly increasing"):
        Grid(batches=(4, 1))
    with pytest.raises(parse_jax.ConfigError, match="repeats must be >= 1"):
        Grid(repeats=0)
    with pytest.raises(parse_jax.ConfigError, match="rounds must be >= 1"):
        Grid(rounds=0)


def test_the_default_grid_times_the_shapes_programs_run():
    """Between grid points a CPU pass's cost is not the line between them, so the default profile times what the
    engine runs: a one-token step and every verification-block bucket up to 128 tokens, the batch sizes the commands
    use, the caches a batch-1 request meets."""
    from parse_jax.runtime.programs import length_bucket
    from parse_jax.verify.round import block_lengths

    grid = Grid()
    assert set(block_lengths(128)) | {1} == set(grid.tokens)
    assert all(length_bucket(t) == t for t in grid.tokens if t > 1)
    assert {1, 4, 8, 16, 64} <= set(grid.batches)  # bench, eval (8), sweep and calibrate (16), the table's 64
    assert {128, 256, 512} <= set(grid.caches)
    # a verification block of 128 tokens is timed at batch 8; batch 64 stops at 16 tokens (filled in proportion)
    assert grid.timed(8, 128) and grid.timed(64, 16) and not grid.timed(64, 24)


def _fake_timers(monkeypatch, readings: dict) -> list:
    """Replace compiled passes by timers of a clean machine (cost grows with rows, tokens and cache), except the
    shapes in `readings` (batch, tokens, cache) -> factors of the clean figure, in order of the timer's calls.
    Returns the list of timed shapes, in call order."""
    calls = []

    def fake_timer(m, batch, tokens, cache_len):
        key = (batch, tokens, cache_len)

        def timer(repeats, warmup):
            calls.append(key)
            clean = 1e-3 * batch * tokens * (1 + cache_len / 16)
            return clean * readings[key][calls.count(key) - 1] if key in readings else clean

        return timer

    monkeypatch.setattr(profile, "_pass_timer", fake_timer)
    return calls


def test_a_pass_slower_than_a_larger_one_is_timed_again_and_the_lower_figure_kept(model, monkeypatch):
    """Interference on a shared machine only adds time: a pass that reads slower than the same pass with more rows,
    more tokens or over a longer cache is timed again, and the lower of its two figures kept; the others are timed
    once."""
    grid = Grid(batches=(1, 2), tokens=(1, 4), caches=(16, 32), max_block_tokens=8, repeats=1, rounds=1)
    readings = {  # the readings in order, where not the clean one
        (1, 4, 16): [10.0, 1.0],   # slower than more rows and than a longer cache; clean on its second timing
        (2, 4, 16): [10.0, 20.0],  # slower than the longer cache only (no larger batch); its second reading worse
        (2, 1, 32): [5.0, 1.0],    # 30e-3 s: slower than more tokens only (2 x 4 tokens: 24e-3; no larger batch,
    }                              # no longer cache)
    calls = _fake_timers(monkeypatch, readings)
    table = profile.profile_model(model, grid)
    assert calls.count((1, 4, 16)) == calls.count((2, 4, 16)) == calls.count((2, 1, 32)) == 2
    assert len(calls) == 8 + 3
    assert table.seconds(1, 4, 16) == pytest.approx(1e-3 * 4 * 2)  # the clean second reading
    assert table.seconds(2, 4, 16) == pytest.approx(1e-3 * 8 * 2 * 10)  # the first, lower than the second
    assert table.seconds(2, 1, 32) == pytest.approx(1e-3 * 2 * 3)  # a suspect in tokens: its clean second reading
    assert table.seconds(2, 4, 32) == pytest.approx(1e-3 * 8 * 3)  # timed once


def test_the_grid_is_timed_in_rounds_and_a_slow_spell_costs_one_round(model, monkeypatch):
    """Every shape is timed once per round before any is timed again, and a shape's figure is the median of its
    rounds: a slow spell of the machine that falls on one round of a shape leaves its figure clean."""
    grid = Grid(batches=(1, 2), tokens=(1, 4), caches=(16,), max_block_tokens=8, repeats=1, rounds=3)
    calls = _fake_timers(monkeypatch, {(1, 4, 16): [3.0, 1.0, 1.0], (2, 1, 16): [3.0, 5.0, 1.0]})
    table = profile.profile_model(model, grid)
    shapes = [(1, 1, 16), (1, 4, 16), (2, 1, 16), (2, 4, 16)]
    assert calls == shapes * 3  # round by round, no suspect left (medians clean or not below a larger shape)
    assert table.seconds(1, 4, 16) == pytest.approx(1e-3 * 4 * 2)  # its slow first round is not the figure
    assert table.seconds(2, 1, 16) == pytest.approx(1e-3 * 2 * 2 * 3)  # slow in two of three rounds: it is


def test_the_heads_model_is_looked_up_without_compiling_and_measured_with_weights(model, tmp_path):
    """An engine's cost model looks the EAGLE-3 head's profile up by a one-layer model's fingerprint: its params as
    shapes, so the lookup compiles nothing (drawing random ones compiled Flax's init, about a second of the first
    `generate`); the fingerprint is the one of the same model with weights, and measuring draws them."""
    from parse_jax.models.model import Model, init_params
    from parse_jax.runtime.programs import setup_split

    layer = model.config.replace(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=12)
    before = setup_split()
    shapes = profile.head_model(layer)
    assert setup_split().compiled == before.compiled
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes.params))
    one = layer.replace(num_layers=1)
    assert profile.fingerprint(shapes, TINY) == profile.fingerprint(Model(one, init_params(one)), TINY)
    weighted = profile._with_weights(shapes)
    assert weighted.attention_impl == shapes.attention_impl and weighted.config == shapes.config
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(weighted.params))
    assert profile.profile_model(shapes, TINY).batches == TINY.batches  # timed with weights drawn
    table = load_or_profile(shapes, measure=True, grid=TINY, folder=tmp_path)
    assert all(x > 0 for p in table.seconds_grid for r in p for x in r)
    assert load_or_profile(profile.head_model(layer), grid=TINY, folder=tmp_path) == table


def test_force_replaces_the_cached_table_only_once_a_new_one_is_whole(model, tmp_path, monkeypatch):
    """`parse-jax profile --force`: an interrupted measurement leaves the cached file as it was (it was deleted
    before measuring once)."""
    load_or_profile(model, measure=True, grid=TINY, folder=tmp_path)
    (path,) = tmp_path.glob("*.json")
    before = path.read_text()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(profile, "profile_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_or_profile(model, measure=True, grid=TINY, folder=tmp_path, force=True)
    assert path.read_text() == before
    monkeypatch.undo()
    assert load_or_profile(model, measure=True, grid=TINY, folder=tmp_path, force=True) is not None
    assert json.loads(path.read_text())["fingerprint"] == json.loads(before)["fingerprint"]


def test_the_profile_command_checks_where_it_writes_before_measuring(tmp_path, monkeypatch, capsys):
    """A --json path under a file, or a profiles folder that is a file, is one line before any measuring."""
    from parse_jax.cli import main

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured before the output paths were checked")

    monkeypatch.setattr(profile, "profile_model", must_not_measure)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "a_file").write_text("x")
    assert main(["profile", "--force", "--json", str(tmp_path / "a_file" / "p.json"), "-q"]) == 2
    assert "a_file is not a folder" in capsys.readouterr().err
    profiles = profile.profiles_dir()
    profiles.parent.mkdir(parents=True)
    profiles.write_text("x")  # the profiles folder's place holds a file
    assert main(["profile", "--force", "-q"]) == 2
    assert f"{profiles} is not a folder" in capsys.readouterr().err


def test_profiling_shows_its_progress_where_phases_are_shown(model, capsys):
    """`parse-jax profile` measured for minutes without a line: a bar counts each shape's compile and each round's
    timing (on stderr, where phase messages are shown; nothing under -q)."""
    import logging

    from parse_jax.utils.progress import logger

    shapes = sum(TINY.timed(b, t) for b in TINY.batches for t in TINY.tokens) * len(TINY.caches)
    steps = shapes * (1 + TINY.rounds)  # each shape compiled once and timed once per round
    level = logger.level
    try:
        logger.setLevel(logging.INFO)  # setLevel, not the attribute: the logger caches isEnabledFor
        profile.profile_model(model, TINY)
        err = capsys.readouterr().err
        assert "profiling passes" in err and f"{steps}/{steps}" in err
        logger.setLevel(logging.WARNING)  # -q
        profile.profile_model(model, TINY)
        assert "profiling passes" not in capsys.readouterr().err
    finally:
        logger.setLevel(level)
