"""Sweeps and threshold calibration: values parse into configs, calibration draws dev problems (never the test
split) and picks a threshold its own sweep numbers justify."""

import dataclasses
import json

import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError, InputError
from parse_jax.harness.runs import RunSettings
from parse_jax.harness.sweep import (
    calibrate,
    parse_value,
    pick_threshold,
    run_sweep,
    sweep_configs,
    sweep_markdown,
    write_sweep,
)
from parse_jax.tasks import load_task
from tests.test_engine import DRAFT, TARGET

BASE = ParseConfig(max_draft_tokens=8, segmenter="stride", stride=3, schedule="fixed")


@pytest.mark.parametrize("param, text, expect", [
    ("threshold", "0.3", {"threshold": 0.3}),
    ("max_prefixes", "4", {"max_prefixes": 4}),
    ("max_draft_tokens", "16", {"max_draft_tokens": 16}),
    ("segmenter", "delimiter", {"segmenter": "delimiter"}),
    ("segmenter", "stride:6", {"segmenter": "stride", "stride": 6}),
])
def test_sweep_values(param, text, expect):
    assert parse_value(param, text) == expect


@pytest.mark.parametrize("param, values, error", [
    ("threshold", ["x"], InputError), ("max_prefixes", ["0"], ConfigError), ("segmenter", ["zigzag"], ConfigError),
    ("segmenter", ["hybrid:3"], InputError), ("temperature", ["1"], InputError), ("threshold", ["0.1", "0.1"],
                                                                                   InputError),
    ("threshold", [], InputError),
])
def test_bad_sweep_values_fail_before_work(param, values, error):
    with pytest.raises(error):
        sweep_configs(BASE, param, values)


def test_a_value_the_config_refuses_is_named_as_given():
    with pytest.raises(ConfigError, match=r"--values for max_prefixes: '0': max_prefixes must be >= 1, got 0"):
        sweep_configs(BASE, "max_prefixes", ["2", " 0"])


def _point(value, acc, accepted, tps=100.0):
    return {"value": value, "accuracy": acc, "accepted_tokens": accepted, "tokens_per_s": tps,
            "speedup_vs_target": tps / 100}


@pytest.mark.parametrize("points, tolerance, expect", [
    ([_point("0.1", 0.80, 50), _point("0.5", 0.89, 40), _point("0.9", 0.90, 20)], 0.01, 0.5),
    ([_point("0.1", 0.80, 50), _point("0.5", 0.89, 40), _point("0.9", 0.90, 20)], 0.2, 0.1),
    ([_point("0.1", 0.90, 40), _point("0.5", 0.90, 40), _point("0.9", 0.90, 20)], 0.0, 0.5),  # equals: strictest
    ([_point("0.1", 0.50, 40), _point("0.5", 0.60, 30)], 0.01, None),
])
def test_pick_threshold(points, tolerance, expect):
    res = {"param": "threshold", "n": 10, "baseline": {"accuracy": 0.9}, "points": points}
    got = pick_threshold(res, tolerance)
    assert got["threshold"] == expect
    assert ("no threshold" in got["message"]) == (expect is None)


def test_calibrate_on_dev_problems_picks_what_its_sweep_supports(tmp_path):
    task = load_task()
    res = calibrate(ParseEngine(TARGET, DRAFT, BASE), task,
                    RunSettings(n=5, max_new_tokens=10, batch_size=5, repeats=1, progress=False), tolerance=0.0,
                    thresholds=[0.0, 0.5, 1.0], log=lambda s: None)
    assert res["split"] == "train" and len(res["prompts"]) == 5
    assert not any(task.is_heldout(p) for p in res["prompts"])  # the dev split is never the test split
    pts = {p["value"]: p for p in res["points"]}
    assert set(pts) == {"0", "0.5", "1"}
    assert pts["1"]["accepted_tokens"] == 0  # threshold 1 accepts nothing (no score reaches 1): PARSE == target
    assert pts["1"]["accuracy"] == res["baseline"]["accuracy"]
    assert pts["0"]["accepted_tokens"] == pts["0"]["draft_tokens"] > 0  # threshold 0 accepts every draft
    chosen = res["calibration"]
    floor = res["baseline"]["accuracy"]
    eligible = [p for p in res["points"] if p["accuracy"] >= floor]
    assert sorted(chosen["eligible"]) == sorted(p["value"] for p in eligible)
    if eligible:
        best = max(p["accepted_tokens"] for p in eligible)
        assert pts[f"{chosen['threshold']:g}"]["accepted_tokens"] == best
        assert all(float(p["value"]) <= chosen["threshold"] for p in eligible if p["accepted_tokens"] == best)
    paths = write_sweep(res, tmp_path, stem="calibrate")
    assert {p.name for p in paths} == {"calibrate.json", "calibrate.md", "calibrate.png", "calibrate_pareto.png"}
    doc = json.loads((tmp_path / "calibrate.json").read_text())
    assert doc["calibration"]["threshold"] == chosen["threshold"]
    assert doc["provenance"]["config"]["split"] == "train" and doc["provenance"]["seed"] == 0


def test_calibrate_runs_parse_as_configured_under_an_auto_engine():
    """A threshold is a property of the verification: calibrate measures PARSE itself even where the engine's
    schedule would decode plainly (at batch 16 on a CPU it does, and every candidate then measured the target)."""
    auto = ParseEngine(TARGET, DRAFT, dataclasses.replace(BASE, schedule="auto"))
    res = calibrate(auto, load_task(), RunSettings(n=4, max_new_tokens=10, batch_size=4, repeats=1, progress=False),
                    thresholds=[0.0, 1.0], log=lambda s: None)
    assert res["parse_config"]["schedule"] == "fixed"
    pts = {p["value"]: p for p in res["points"]}
    assert pts["0"]["accepted_tokens"] == pts["0"]["draft_tokens"] > 0 and not pts["0"]["schedule_ran"]


def test_a_sweep_report_says_what_the_auto_schedule_ran_per_value():
    res = run_sweep(ParseEngine(TARGET, DRAFT, dataclasses.replace(BASE, schedule="auto")), load_task(),
                    "threshold", ["0.5"], RunSettings(n=4, max_new_tokens=10, batch_size=4, repeats=1,
                                                      progress=False))
    ran = res["points"][0]["schedule_ran"]
    assert len(ran) == 1 and list(ran.values()) == [1]  # one call of one batch: one decision
    (name,) = ran
    assert name == "target" or name.startswith("parse")
    text = sweep_markdown(res, "t")
    assert "What `schedule=\"auto\"` ran for each value in the timed repeats" in text and f"0.5: {name} x1." in text


def test_sweep_runs_target_once_and_each_value():
    res = run_sweep(ParseEngine(TARGET, DRAFT, BASE), load_task(), "max_prefixes", ["1", "4"],
                    RunSettings(n=5, max_new_tokens=10, batch_size=5, repeats=1, progress=False))
    assert res["split"] == "test" and all(load_task().is_heldout(p) for p in res["prompts"])
    assert [p["value"] for p in res["points"]] == ["1", "4"]
    assert res["baseline"]["speedup_vs_target"] == pytest.approx(1.0)
    for p in res["points"]:
        assert p["speedup_vs_target"] == pytest.approx(p["tokens_per_s"] / res["baseline"]["tokens_per_s"])
