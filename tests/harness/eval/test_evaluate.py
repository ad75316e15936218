"""`pj.evaluate`: the call `parse-jax eval` makes, on steps of training runs, and cheap to call from a training loop
(new params, nothing compiled again)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parse_jax as pj
from parse_jax.cli import main
from parse_jax.harness.eval.data import write_task_jsonl
from parse_jax.harness.eval.report import wilson
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.runtime.programs import compiled_programs
from parse_jax.tasks import TOKENIZER_DIR, load_task
from tests.checkpoints.runs_fixture import write_run
from tests.random_models import random_model

TOK = Tokenizer.from_folder(TOKENIZER_DIR)
TASK = load_task()
CFG = pj.ParseConfig(max_draft_tokens=12, schedule="fixed")
COMPARED = ("key", "line", "correct", "extracted", "reference", "new_tokens", "output", "accepted_tokens",
            "verify_passes")


def _model(seed, family):
    m = random_model(family, seed, vocab_size=TOK.vocab_size)
    return Model(m.config, m.params, TOK)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two training runs laid out as this project's trainer does (RUN/run.json + RUN/ckpt/<step>/{state,meta})."""
    root = tmp_path_factory.mktemp("runs")
    write_run(root / "target_run", _model(40, "qwen3"), steps=(10, 30), run_json=True)
    write_run(root / "draft_run", _model(41, "llama3"), steps=(50,), run_json=True)
    return root / "target_run", root / "draft_run"


def test_evaluate_equals_parse_jax_eval_on_the_same_file(runs, tmp_path, capsys):
    target_run, draft_run = runs
    data = write_task_jsonl(TASK, 10, tmp_path / "data.jsonl", seed=3)
    kw = dict(mode="parse", config=CFG, batch_size=4, max_new_tokens=16)
    target, draft = pj.load_model(target_run, step=10), pj.load_model(draft_run)
    res = pj.evaluate(target, draft, data, **kw)
    out = tmp_path / "results.jsonl"
    rc = main(["eval", "--data", str(data), "--target", str(target_run), "--step", "10", "--draft", str(draft_run),
               "--mode", "parse", "--max-draft-tokens", "12", "--schedule", "fixed", "--batch-size", "4",
               "--max-new-tokens", "16", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    header, rows = lines[0], lines[1:]
    assert header["settings"]["models"]["target_step"] == 10 and header["settings"]["models"]["draft_step"] == 50
    assert len(rows) == len(res.records) == res.n == 10
    for a, b in zip(rows, res.records, strict=True):
        assert {k: a.get(k) for k in COMPARED} == {k: b.get(k) for k in COMPARED}
    summary = json.loads((tmp_path / "results.summary.json").read_text())
    for key in ("n", "correct", "accuracy", "accuracy_ci95", "new_tokens", "accepted_per_pass"):
        assert summary[key] == res.summary[key], key
    # the step matters: the latest step of the same run writes other outputs
    latest = pj.evaluate(pj.load_model(target_run), draft, data, **kw)
    assert [r["output"] for r in latest.records] != [r["output"] for r in res.records]


def test_eval_result_fields(runs):
    target_run, draft_run = runs
    res = pj.evaluate(pj.load_model(target_run), pj.load_model(draft_run), TASK.problems(6, seed=2), config=CFG,
                      batch_size=3, max_new_tokens=16)
    assert isinstance(res, pj.EvalResult) and res.n == 6 and len(res.records) == 6
    assert res.correct == sum(r["correct"] for r in res.records)
    assert res.accuracy == res.correct / 6 and res.accuracy_ci95 == wilson(res.correct, 6)
    assert res.new_tokens == sum(r["new_tokens"] for r in res.records) > 0
    assert res.tokens_per_s == pytest.approx(res.new_tokens / res.seconds)
    accepted = sum(r["accepted_tokens"] for r in res.records)
    assert res.accepted_per_pass == pytest.approx(accepted / sum(r["verify_passes"] for r in res.records))


def test_evaluate_and_eval_honour_the_rounds_a_config_sets(runs, tmp_path, capsys):
    """Mode "parse" runs the rounds the config sets (threshold 1 keeps no step: single round verifies once per
    record, multi round again after each step of at most max_segment tokens the target writes); "auto" is the
    mode name's single round. `parse-jax eval --rounds multi` runs what the API runs."""
    import dataclasses

    target_run, draft_run = runs
    target, draft = pj.load_model(target_run), pj.load_model(draft_run)
    data = write_task_jsonl(TASK, 4, tmp_path / "data.jsonl", seed=5)
    passes = {}
    for rounds in ("single", "multi", "auto"):
        cfg = dataclasses.replace(CFG, threshold=1.0, max_segment=4, rounds=rounds)
        res = pj.evaluate(target, draft, data, config=cfg, batch_size=2, max_new_tokens=16)
        passes[rounds] = [r["verify_passes"] for r in res.records]
    assert passes["single"] == passes["auto"] == [1] * 4 and min(passes["multi"]) > 1
    out = tmp_path / "r.jsonl"
    rc = main(["eval", "--data", str(data), "--target", str(target_run), "--draft", str(draft_run), "--mode", "parse",
               "--rounds", "multi", "--threshold", "1", "--set", "max_segment=4", "--max-draft-tokens", "12",
               "--schedule", "fixed", "--batch-size", "2", "--max-new-tokens", "16", "--out", str(out),
               "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert [json.loads(x)["verify_passes"] for x in out.read_text().splitlines()[1:]] == passes["multi"]


class BackendCompiles:
    """Counts XLA compilations (jax's backend-compile event), whatever program they are for."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self)


def test_evaluate_with_params_fresh_from_the_optimizer_compiles_nothing():
    """A training loop: evaluate, take an optimizer step, evaluate the new params. The second call reloads nothing
    and compiles nothing; it does use the new params. The loop's arrays are uncommitted (it started from host
    arrays) while the loaded model's are committed to their device, as `load_model`'s are: `with_params` places them
    like the model's, else jit would compile anew for them."""
    device = jax.devices()[0]
    target, draft = _model(40, "qwen3"), _model(41, "llama3")
    target.params, draft.params = jax.device_put((target.params, draft.params), device)  # as load_model gives them
    records = TASK.problems(6, seed=4)
    opt = optax.sgd(1e-4)
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), target.params)
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.cos(x)) for x in jax.tree.leaves(p)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    kw = dict(mode="parse", config=CFG, batch_size=3, max_new_tokens=16)
    first = pj.evaluate(target, draft, records, **kw)  # the checkpoint as loaded
    new_params, opt_state = train_step(params, opt_state)
    new_params, opt_state = train_step(new_params, opt_state)
    assert not jax.tree.leaves(new_params)[0].committed
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(target.params), jax.tree.leaves(new_params)))
    before = compiled_programs()
    with BackendCompiles() as compiles:
        second = pj.evaluate(target.with_params(new_params), draft, records, **kw)
    assert compiles.count == 0 and compiled_programs() == before
    assert second.n == first.n == 6
    # the new params are the ones used: far-off params of the same shapes write other text
    other = pj.evaluate(target.with_params(_model(7, "qwen3").params), draft, records, **kw)
    assert [r["output"] for r in other.records] != [r["output"] for r in second.records]


def test_with_params_keeps_the_model_and_checks_the_tree():
    target = _model(40, "qwen3")
    doubled = jax.tree.map(lambda x: 2 * x, target.params)
    m = target.with_params(doubled)
    assert m.config is target.config and m.tokenizer is target.tokenizer and m.params is not target.params
    np.testing.assert_array_equal(m.params["norm"]["scale"], 2 * np.asarray(target.params["norm"]["scale"]))
    bad = jax.tree.map(lambda x: x, doubled)
    bad["norm"]["scale"] = np.zeros(5, np.float32)
    with pytest.raises(pj.ConfigError, match=r"with_params: \['norm'\]\['scale'\] is float32\[5\], the model's is "
                                             r"float32\[48\]"):
        target.with_params(bad)
    del bad["norm"]
    with pytest.raises(pj.ConfigError, match=r"tree differs from the model's at \['norm'\]\['scale'\]"):
        target.with_params(bad)


def test_the_counter_sees_a_compilation():
    """The compile counter of the test above is not blind: a program of a new shape counts."""
    with BackendCompiles() as compiles:
        jax.jit(lambda x: x * 3 + 1)(jnp.zeros((7, 13, 3)))
    assert compiles.count >= 1


def test_an_eval_on_a_step_saved_again_is_not_resumed(tmp_path, capsys):
    """A run started over reuses its step numbers: a results file started on step 10 is not resumed on the new
    step 10 (its weights differ), where the step number alone matched and the summary mixed the two."""
    import shutil

    run = tmp_path / "run"
    write_run(run, _model(42, "qwen3"), steps=(10,), run_json=True)
    data = write_task_jsonl(TASK, 4, tmp_path / "data.jsonl", seed=3)
    cmd = ["eval", "--data", str(data), "--target", str(run), "--step", "10", "--mode", "target",
           "--max-new-tokens", "8", "--out", str(tmp_path / "r.jsonl"), "--no-progress", "-q"]
    assert main([*cmd, "--limit", "2"]) == 0
    assert main([*cmd, "--limit", "3"]) == 0, capsys.readouterr().err  # the same step: resumed
    shutil.rmtree(run)
    write_run(run, _model(43, "qwen3"), steps=(10,), run_json=True)
    capsys.readouterr()
    assert main([*cmd, "--limit", "4"]) == 2
    err = capsys.readouterr().err
    assert "on other weights: the target step was saved again since" in err and "\n" not in err.strip()
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 1 + 3  # the file as it was
