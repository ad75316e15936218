"""Trainer: the loss falls, resume after a crash or a kill -9 gives the uninterrupted result, bad resumes fail."""

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pallas_kernels.reference import visibility
from parse_jax.checkpoints.orbax import params_equal
from parse_jax.errors import CheckpointError
from parse_jax.models.model import Model, init_params
from parse_jax.train.data import BatchStream, RowMix
from parse_jax.train.forward import train_logits
from parse_jax.train.pipeline import model_config
from parse_jax.train.recipe import ModelSpec, PhaseSpec
from parse_jax.train.trainer import CKPT_DIR, PhaseOptions, latest_step, train_phase


class Crash(Exception):
    pass


def _stream(task, enc, spec, judge=True):
    return BatchStream(task, enc, 44, spec.batch_size, spec.seed, judge=judge, mix=RowMix(error_fraction=0.5))


def _steps(folder):
    return sorted(int(p.name) for p in (folder / CKPT_DIR).iterdir() if p.name.isdigit())


@pytest.mark.parametrize("spec_kw", [dict(num_kv_heads=1, tie_word_embeddings=True),
                                     dict(num_kv_heads=2, tie_word_embeddings=False)])
def test_training_forward_equals_model_logits(tok, spec_kw):
    cfg = model_config(ModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48,
                                 max_position_embeddings=64, **spec_kw), tok)
    params = init_params(cfg, seed=5)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 17)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(train_logits(params, cfg, ids)), Model(cfg, params).logits(ids),
                               atol=2e-5, rtol=1e-5)


def test_training_forward_equals_model_logits_under_yarn():
    """yarn scales cos/sin by its attention factor (1 + 0.1 ln 4 here): the training forward too, or a head trained
    for a yarn target (train-eagle3) learns another model's features."""
    from parse_jax.models.config import config_from_hf, rope_attention_scaling

    cfg = config_from_hf({"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 50,
                          "max_position_embeddings": 64, "tie_word_embeddings": True,
                          "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 16}})
    assert rope_attention_scaling(cfg) > 1.1
    params = init_params(cfg, seed=5)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(train_logits(params, cfg, ids)), Model(cfg, params).logits(ids),
                               atol=2e-5, rtol=1e-5)


def test_packed_rows_score_each_copy_like_its_standalone_verification_prompt(tok, task, enc):
    """The training forward over a packed row (design.md §2) gives every judge position the logits of a plain
    causal pass over that prefix's verification prompt."""
    cfg = model_config(ModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48,
                                 max_position_embeddings=64), tok)
    params = init_params(cfg, seed=3)
    b = _stream(task, enc, dataclasses.replace(PhaseSpec(), batch_size=4)).batch(2)
    logits = np.asarray(train_logits(params, cfg, b["tokens"], b["positions"], b["limit"], b["group"]))
    vis = np.asarray(visibility(np.zeros(4, np.int32), b["limit"], b["group"], b["tokens"].shape[1]))
    model = Model(cfg, params)
    checked = 0
    for r in range(4):
        for i in np.flatnonzero(b["judge_mask"][r]):
            ids = b["tokens"][r][np.flatnonzero(vis[r, i])]
            np.testing.assert_allclose(logits[r, i], model.logits(ids[None])[0, -1], atol=2e-5, rtol=1e-5)
            checked += 1
    assert checked >= 12


def test_a_short_run_lowers_the_loss(task, enc, tiny_cfg, tiny_spec, tmp_path):
    spec = dataclasses.replace(tiny_spec, steps=30, batch_size=16, lr=1e-2, checkpoint_every=30)
    _, hist = train_phase("t", tiny_cfg, spec, _stream(task, enc, spec, False).batch, tmp_path / "run", {},
                          PhaseOptions(progress=False))
    assert hist[0]["step"] == 1 and hist[-1]["step"] == 30
    first = float(np.mean([h["loss"] for h in hist[:1]]))
    assert np.isfinite(first) and hist[-1]["loss"] < 0.8 * first


def test_resume_after_a_crash_equals_an_uninterrupted_run(task, enc, tiny_cfg, tiny_spec, tmp_path):
    stream = _stream(task, enc, tiny_spec)
    ref, _ = train_phase("t", tiny_cfg, tiny_spec, stream.batch, tmp_path / "ref", {}, PhaseOptions(progress=False))

    def crash_at_6(step):
        if step == 6:
            raise Crash

    run = tmp_path / "run"
    with pytest.raises(Crash):
        train_phase("t", tiny_cfg, tiny_spec, stream.batch, run, {}, PhaseOptions(on_step=crash_at_6, progress=False))
    assert _steps(run) == [4]  # the finished checkpoint survives the crash
    seen = []
    out, _ = train_phase("t", tiny_cfg, tiny_spec, stream.batch, run, {},
                         PhaseOptions(on_step=seen.append, progress=False))
    assert seen[0] == 5 and seen[-1] == 12 and latest_step(run) == 12
    assert _steps(run) == [8, 12]  # keep_checkpoints=2
    assert params_equal(out, ref)
    # A finished run restores and trains no further.
    again, _ = train_phase("t", tiny_cfg, tiny_spec, stream.batch, run, {},
                           PhaseOptions(on_step=seen.append, progress=False))
    assert seen[-1] == 12 and params_equal(again, ref)


@pytest.mark.subprocess
def test_kill_9_mid_run_then_rerun_reaches_the_same_step(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, dataclasses
        from parse_jax.tasks import load_task
        from parse_jax.train.data import BatchStream, Encoder
        from parse_jax.train.pipeline import load_tokenizer, model_config
        from parse_jax.train.recipe import ModelSpec, PhaseSpec, PhaseSpec
        from parse_jax.train.trainer import PhaseOptions, train_phase
        tok, task = load_tokenizer(), load_task()
        cfg = model_config(ModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                     intermediate_size=64, max_position_embeddings=64), tok)
        spec = dataclasses.replace(PhaseSpec(), steps=10, batch_size=8, warmup_steps=2, checkpoint_every=3,
                                   keep_checkpoints=3)
        stream = BatchStream(task, Encoder(tok, task), 40, 8, 0)
        kill = int(sys.argv[1])
        def on_step(s):
            if s == kill:
                os.kill(os.getpid(), signal.SIGKILL)
        train_phase("t", cfg, spec, stream.batch, {str(tmp_path / "run")!r}, {{}},
                    PhaseOptions(on_step=on_step, progress=False))
        print("finished")
    """)
    r = subprocess.run([sys.executable, "-c", script, "7"], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    assert _steps(tmp_path / "run") == [3, 6]
    r = subprocess.run([sys.executable, "-c", script, "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "finished" in r.stdout, r.stderr
    assert _steps(tmp_path / "run") == [6, 9, 10]


def test_resume_from_another_config_is_an_error(task, enc, tiny_cfg, tiny_spec, tmp_path):
    spec = dataclasses.replace(tiny_spec, steps=4)
    train_phase("t", tiny_cfg, spec, _stream(task, enc, spec).batch, tmp_path / "run", {}, PhaseOptions(progress=False))
    other = tiny_cfg.replace(hidden_size=64, head_dim=32)
    with pytest.raises(CheckpointError, match="another config.*hidden_size"):
        train_phase("t", other, spec, _stream(task, enc, spec).batch, tmp_path / "run", {},
                    PhaseOptions(progress=False))
    with pytest.raises(CheckpointError, match="another config.*lr"):
        train_phase("t", tiny_cfg, dataclasses.replace(spec, lr=1.0), _stream(task, enc, spec).batch,
                    tmp_path / "run", {}, PhaseOptions(progress=False))
    with pytest.raises(CheckpointError, match="another config.*judge"):
        train_phase("t", tiny_cfg, spec, _stream(task, enc, spec).batch, tmp_path / "run", {"judge": 1},
                    PhaseOptions(progress=False))


def test_missing_and_corrupt_checkpoints_are_errors(task, enc, tiny_cfg, tiny_spec, tmp_path):
    spec = dataclasses.replace(tiny_spec, steps=4)
    stream = _stream(task, enc, spec)
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        train_phase("t", tiny_cfg, spec, stream.batch, tmp_path / "none", {},
                    PhaseOptions(mode="resume", progress=False))
    run = tmp_path / "run"
    train_phase("t", tiny_cfg, spec, stream.batch, run, {}, PhaseOptions(progress=False))
    for f in (run / CKPT_DIR / "4" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="missing or corrupt"):
        train_phase("t", tiny_cfg, spec, stream.batch, run, {}, PhaseOptions(progress=False))
    # --fresh starts over.
    out, _ = train_phase("t", tiny_cfg, spec, stream.batch, run, {}, PhaseOptions(mode="fresh", progress=False))
    assert latest_step(run) == 4
