"""Widening a trained decoder keeps its function; the recipe's grow phase trains the wide model and resumes."""

import shutil

import jax
import numpy as np
import pytest

from parse_jax import load_model
from parse_jax.cli import main
from parse_jax.errors import ConfigError
from parse_jax.models.model import Model
from parse_jax.train.grow import check_growable, grown_config, widen_params
from parse_jax.train.trainer import latest_step
from tests.random_models import random_model


@pytest.mark.parametrize("family,widths", [
    ("llama3", dict(hidden_size=96, intermediate_size=160, num_heads=6, num_kv_heads=3)),
    ("qwen2", dict(hidden_size=128, intermediate_size=128, num_heads=16, num_kv_heads=4)),  # bias, tied
    ("qwen3", dict(hidden_size=80, intermediate_size=200, num_heads=4, num_kv_heads=2)),    # FFN only, untied
])
@pytest.mark.parametrize("seed", [0, 5])
def test_widened_model_has_the_same_logits(family, widths, seed):
    # q/k norms are refused (below); o_proj and MLP biases are exercised here
    small = random_model(family, seed, qk_norm=False, o_bias=family == "qwen3", mlp_bias=family == "qwen3")
    wide_cfg = grown_config(small.config, small.config.replace(**widths))
    wide = Model(wide_cfg, jax.tree.map(jax.numpy.asarray, widen_params(small.params, small.config, wide_cfg, seed)))
    assert wide_cfg.num_params > small.config.num_params
    ids = np.random.default_rng(seed).integers(0, small.config.vocab_size, (2, 19))
    a, b = small.logits(ids), wide.logits(ids)
    np.testing.assert_allclose(b, a, atol=2e-5 * np.abs(a).max(), rtol=0)
    # the widening is not a no-op: new weights are random or zero, never the old ones repeated
    q_new = np.asarray(wide.params["layers_0"]["self_attn"]["q_proj"]["kernel"])
    assert np.abs(q_new[small.config.hidden_size:]).mean() > 0


def test_models_with_qk_norm_are_refused():
    small = random_model("qwen3")
    with pytest.raises(ConfigError, match="q/k RMSNorm"):
        check_growable(small.config, grown_config(small.config, small.config.replace(hidden_size=96)))


def test_eps_must_be_rescaled_and_widths_must_grow():
    small = random_model("llama3")
    cfg = small.config
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        check_growable(cfg, cfg.replace(hidden_size=128))
    with pytest.raises(ConfigError, match="intermediate_size would shrink"):
        check_growable(cfg, grown_config(cfg, cfg.replace(intermediate_size=32)))
    with pytest.raises(ConfigError, match="num_layers differs"):
        check_growable(cfg, cfg.replace(num_layers=3))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        check_growable(cfg, cfg.replace(num_heads=8))
    # without the eps correction the wide model drifts measurably: the correction is what makes it exact
    wide_cfg = grown_config(cfg, cfg.replace(hidden_size=256, num_heads=16, num_kv_heads=8))
    p = widen_params(small.params, cfg, wide_cfg)
    ids = np.arange(12)[None] % cfg.vocab_size
    exact = Model(wide_cfg, p).logits(ids)
    drift = Model(wide_cfg.replace(rms_norm_eps=cfg.rms_norm_eps), p).logits(ids)
    assert np.abs(exact - small.logits(ids)).max() < np.abs(drift - small.logits(ids)).max()


GROW = """
seq_len: 44
draft_model: {hidden_size: 16, num_layers: 1, num_heads: 2, num_kv_heads: 2, intermediate_size: 32}
target_model: {hidden_size: 16, num_layers: 2, num_heads: 2, num_kv_heads: 1, intermediate_size: 32}
draft: {steps: 4, batch_size: 8, warmup_steps: 1, checkpoint_every: 2}
target: {steps: 30, batch_size: 16, lr: 0.01, warmup_steps: 2, checkpoint_every: 30}
judge: {error_fraction: 0.5, real_fraction: 0.5, draft_samples: 16, sample_batch: 16}
grow:
  enabled: true
  model: {hidden_size: 48, num_layers: 2, num_heads: 6, num_kv_heads: 3, intermediate_size: 64}
  phase: {steps: STEPS, batch_size: 16, lr: 0.003, warmup_steps: 2, checkpoint_every: 4, seed: 1}
"""


def _loss(model, recipe_path, seed=11):
    from parse_jax.tasks import load_task
    from parse_jax.train.data import BatchStream, Encoder, RowMix
    from parse_jax.train.trainer import loss_fn

    task = load_task()
    stream = BatchStream(task, Encoder(model.tokenizer, task), 44, 64, seed, judge=True,
                         mix=RowMix(error_fraction=0.5))
    batch = stream.batch(0)
    return float(loss_fn(model.params, model.config, batch, 1.0)[0])


def test_recipe_grows_the_target_lowers_its_loss_and_resumes(tmp_path):
    recipe = tmp_path / "grow.yaml"
    recipe.write_text(GROW.replace("STEPS", "12"))
    out = tmp_path / "pair"
    assert main(["train", "--recipe", str(recipe), "--out", str(out), "--no-progress"]) == 0
    narrow, wide = load_model(out / "target_narrow"), load_model(out / "target")
    assert (narrow.config.hidden_size, wide.config.hidden_size) == (16, 48)
    assert wide.config.rms_norm_eps == pytest.approx(narrow.config.rms_norm_eps / 3)
    assert latest_step(out / "grow_run") == 12
    # the grow phase starts from the narrow model's function (its loss) and lowers it on held-out batches
    assert _loss(wide, recipe) < _loss(narrow, recipe)
    # a run killed after its step-8 checkpoint: the rerun resumes there and ends on the same weights
    shutil.rmtree(out / "grow_run" / "ckpt" / "12")
    assert latest_step(out / "grow_run") == 8
    assert main(["train", "--recipe", str(recipe), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert latest_step(out / "grow_run") == 12
    resumed = load_model(out / "target")
    for a, b in zip(jax.tree.leaves(wide.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    # killed before the grow phase's first checkpoint: --resume starts that phase over, from the same widening
    shutil.rmtree(out / "grow_run")
    assert main(["train", "--recipe", str(recipe), "--out", str(out), "--resume", "--no-progress"]) == 0
    again = load_model(out / "target")
    for a, b in zip(jax.tree.leaves(wide.params), jax.tree.leaves(again.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)


def test_a_recipe_that_cannot_grow_is_a_config_error(tmp_path, capsys):
    for bad, why in (("num_heads: 6", "num_heads: 0"), ("num_layers: 2, num_heads: 6", "num_layers: 3, num_heads: 6"),
                     ("hidden_size: 48", "hidden_size: 8")):
        recipe = tmp_path / "bad.yaml"
        assert bad in GROW
        recipe.write_text(GROW.replace("STEPS", "2").replace(bad, why, 1))
        assert main(["train", "--recipe", str(recipe), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert "grow.model" in err and "\n" not in err and "Traceback" not in err, err


def test_grow_from_needs_a_growing_recipe_and_the_recipe_shape(tmp_path, capsys):
    recipe = tmp_path / "grow.yaml"
    recipe.write_text(GROW.replace("STEPS", "2"))
    plain = tmp_path / "plain.yaml"
    plain.write_text(GROW.replace("enabled: true", "enabled: false").replace("STEPS", "2"))
    other = random_model("llama3")
    from parse_jax import save_model
    from parse_jax.train.pipeline import load_tokenizer
    other.tokenizer = load_tokenizer()
    save_model(other, tmp_path / "other")
    assert main(["train", "--recipe", str(plain), "--out", str(tmp_path / "a"), "--grow-from",
                 str(tmp_path / "other"), "--no-progress"]) == 2
    assert "grow.enabled" in capsys.readouterr().err
    assert main(["train", "--recipe", str(recipe), "--out", str(tmp_path / "b"), "--grow-from",
                 str(tmp_path / "other"), "--no-progress"]) == 2
    assert "not the recipe's target_model" in capsys.readouterr().err


def test_a_fresh_rerun_growing_from_its_own_narrow_target_keeps_that_folder(tmp_path, monkeypatch):
    """`--fresh --grow-from OUT/target_narrow`: the narrow target is the user's input, so --fresh does not delete it
    with the rest (an interrupt before the run saves it again would have lost the only copy)."""
    from parse_jax.train import pipeline
    from parse_jax.train.recipe import load_recipe

    recipe = tmp_path / "grow.yaml"
    recipe.write_text(GROW.replace("STEPS", "2"))
    out = tmp_path / "pair"
    assert main(["train", "--recipe", str(recipe), "--out", str(out), "--no-progress"]) == 0

    class Interrupt(Exception):
        pass

    def interrupted(*args, **kwargs):  # the rerun is stopped in its first phase, after --fresh cleared the run
        raise Interrupt

    monkeypatch.setattr(pipeline, "train_phase", interrupted)
    with pytest.raises(Interrupt):
        pipeline.run_recipe(load_recipe(str(recipe)), out=out, mode="fresh", progress=False, quiet=True,
                            grow_from=out / "target_narrow")
    assert load_model(out / "target_narrow").config.hidden_size == 16
    assert not (out / "target").exists() and not (out / "draft_run").exists()  # the rest was cleared
