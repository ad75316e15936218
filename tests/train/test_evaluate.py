"""`python -m parse_jax.train.evaluate`: `--n` bounds every measure's problems (the synthetic prefixes too), and
the results are strict JSON (an undefined measure is null, never a bare NaN)."""

import json

import pytest

from parse_jax.tasks import load_task
from parse_jax.train import evaluate
from parse_jax.train.evaluate import heldout_prefixes


def _strict(text: str):
    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_n_bounds_the_synthetic_prefixes_and_the_json_is_strict(pair_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "step_seconds", lambda model, batch: 1e-3)  # timing is not what this checks
    out = tmp_path / "eval.json"
    assert evaluate.main(["--pair", str(pair_dir), "--n", "2", "--json", str(out)]) == 0
    res = _strict(out.read_text())
    assert _strict(capsys.readouterr().out) == res
    expected, _ = heldout_prefixes(load_task(), [], n_synthetic=2)  # the synthetic prefixes of 2 problems
    assert res["n"] == res["n_synthetic_problems"] == 2
    assert res["n_synthetic"] == len(expected) and res["n_prefixes"] == res["n_draft"] + len(expected)
    # the random pair's draft solves nothing: the share of its correct solutions that differ is undefined, null
    if res["draft_accuracy"] == 0:
        assert res["draft_correct_differs_from_target"] is None


def test_a_non_positive_n_is_one_line(capsys):
    assert evaluate.main(["--n", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--n must be >= 1, got 0" in err[0]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_undefined_measures_are_null(value, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "evaluate_pair", lambda out, n: {"n": n, "auroc_draft": value, "rows": [value, 1.0]})
    assert evaluate.main(["--n", "3", "--json", str(tmp_path / "e.json")]) == 0
    res = _strict((tmp_path / "e.json").read_text())
    assert res["auroc_draft"] is None and res["rows"] == [None, 1.0] and res["n"] == 3
    assert _strict(capsys.readouterr().out) == res
