"""The bench harness on random models: every mode runs, the numbers are consistent with each other."""

import json

import numpy as np
import pytest

from parse_jax.bench import run_bench, write_json
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import InputError
from parse_jax.tasks import load_task
from tests.test_engine import DRAFT, TARGET


def test_bench_on_five_problems(tmp_path):
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(max_draft_tokens=8, segmenter="stride", stride=3))
    lines = []
    res = run_bench(eng, load_task(), n=5, modes=["sd", "sequential", "parse", "draft"], max_new_tokens=10,
                    batch_size=3, repeats=2, progress=False, log=lines.append)
    assert set(res["modes"]) == {"target", "sd", "sequential", "parse", "draft"}
    for r in res["modes"].values():
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["new_tokens"] > 0 and len(r["tokens_per_s_all"]) == 2
        np.testing.assert_allclose(r["tokens_per_s_all"], r["new_tokens"] / np.array(r["seconds_all"]))
        assert min(r["tokens_per_s_all"]) <= r["tokens_per_s"] <= max(r["tokens_per_s_all"])
    assert res["modes"]["target"]["speedup_vs_target"] == pytest.approx(1.0)
    assert res["modes"]["target"]["new_tokens"] == res["modes"]["sd"]["new_tokens"]  # greedy sd == target
    parse = res["modes"]["parse"]
    assert parse["verify_passes"] == 2  # one per batch of 3 (5 problems)
    assert 0 <= parse["accepted_tokens"] <= parse["draft_tokens"]
    assert parse["accepted_per_pass"] == pytest.approx(parse["accepted_tokens"] / 5)  # one check per request
    assert res["modes"]["target"]["target_passes_per_100_tokens"] >= 100.0  # one pass per token, per request
    assert res["modes"]["sequential"]["accepted_tokens"] == parse["accepted_tokens"]
    assert "| parse |" in lines[0]
    path = write_json(res, tmp_path / "out" / "bench.json")
    again = json.loads(path.read_text())
    assert again["modes"]["parse"]["accuracy"] == res["modes"]["parse"]["accuracy"]
    assert again["provenance"]["jax"]


def test_unknown_mode_is_refused():
    eng = ParseEngine(TARGET, DRAFT)
    with pytest.raises(InputError, match="unknown mode"):
        run_bench(eng, load_task(), n=2, modes=["warp"], progress=False)
