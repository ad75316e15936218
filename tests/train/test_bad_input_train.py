"""A run whose loss or params turn NaN stops with a clear error and never writes a checkpoint of them."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from parse_jax.train.data import BatchStream, RowMix
from parse_jax.train.trainer import CKPT_DIR, PhaseOptions, TrainingError, latest_step, train_phase


def _stream(task, enc, spec):
    return BatchStream(task, enc, 44, spec.batch_size, spec.seed, judge=False, mix=RowMix(error_fraction=0.5))


def test_a_nan_loss_stops_training_before_any_checkpoint(task, enc, tiny_cfg, tiny_spec, tmp_path):
    spec = dataclasses.replace(tiny_spec, steps=8, checkpoint_every=4)
    stream = _stream(task, enc, spec)
    run = tmp_path / "run"
    train_phase("t", tiny_cfg, dataclasses.replace(spec, steps=4), stream.batch, run, {}, PhaseOptions(progress=False))
    assert latest_step(run) == 4  # a good checkpoint to keep

    def nan_loss(params, batch):  # a diverged run: every value NaN from here on
        return jnp.nan * sum(jnp.sum(x) for x in jax.tree.leaves(params)), {}

    with pytest.raises(TrainingError, match=r"training t2 diverged at step \d+ \(loss nan"):
        train_phase("t2", tiny_cfg, spec, stream.batch, tmp_path / "bad", {},
                    PhaseOptions(loss=nan_loss, progress=False))
    bad = tmp_path / "bad" / CKPT_DIR
    assert not bad.exists() or not any(p.name.isdigit() for p in bad.iterdir())
    assert latest_step(run) == 4


def test_eagle3_training_refuses_a_nan_learning_rate_before_any_work(tmp_path):
    from parse_jax.errors import ConfigError
    from parse_jax.train.eagle3 import Eagle3Spec

    with pytest.raises(ConfigError, match="lr must be a finite number, got nan"):
        Eagle3Spec(lr=float("nan"))
    assert list(tmp_path.iterdir()) == []
