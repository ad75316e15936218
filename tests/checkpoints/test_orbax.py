"""parse-jax checkpoints: lossless Orbax round trips, HF conversion, safe overwrite, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from parse_jax.checkpoints.hf import load_hf
from parse_jax.checkpoints.load import convert_hf, load_model
from parse_jax.checkpoints.orbax import CONFIG_FILE, PARAMS_DIR, params_equal, save_model
from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.model import Model
from tests.models.hf_tiny import VOCAB

IDS = np.random.default_rng(3).integers(0, VOCAB, size=(2, 17))


def _model(tiny_hf, family: str, seed: int = 0, tokenizer: bool = True) -> Model:
    model = load_hf(tiny_hf(family, seed=seed))
    return model if tokenizer else Model(model.config, model.params)


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bitwise(tiny_hf, tmp_path, dtype: str) -> None:
    model = load_hf(tiny_hf("qwen3", dtype=dtype))
    path = save_model(model, tmp_path / "ckpt")
    assert (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir() and (path / "tokenizer.json").is_file()
    back = load_model(path)
    assert back.config == model.config and back.config.dtype == dtype
    assert {x.dtype for x in jax.tree.leaves(back.params)} == {jnp.dtype(dtype)}
    assert params_equal(back.params, model.params)
    assert (back.tokenizer.bos_id, back.tokenizer.eos_id) == (model.tokenizer.bos_id, model.tokenizer.eos_id)
    assert back.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    np.testing.assert_array_equal(back.logits(IDS), model.logits(IDS))


@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_without_tokenizer(tiny_hf, tmp_path, seed: int) -> None:
    model = _model(tiny_hf, "qwen2", seed, tokenizer=False)
    back = load_model(save_model(model, tmp_path / "ckpt"))
    assert back.tokenizer is None and not (tmp_path / "ckpt" / "tokenizer.json").exists()
    assert back.config == model.config and params_equal(back.params, model.params)
    assert not params_equal(back.params, _model(tiny_hf, "qwen2", 1 - seed).params)


def test_convert_hf_gives_identical_logits(tiny_hf, tmp_path) -> None:
    hf_dir = tiny_hf("llama3", seed=1)
    out = convert_hf(hf_dir, tmp_path / "converted")
    ours, reference = load_model(out), load_model(hf_dir)
    np.testing.assert_array_equal(ours.logits(IDS), reference.logits(IDS))
    assert ours.tokenizer.encode("hello world") == reference.tokenizer.encode("hello world")
    bf16 = load_model(convert_hf(hf_dir, tmp_path / "bf16", dtype="bfloat16"))
    assert bf16.config.dtype == "bfloat16"
    assert params_equal(bf16.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), reference.params))
    upcast = load_model(tmp_path / "bf16", dtype="float32")  # dtype override on an Orbax checkpoint
    assert upcast.config.dtype == "float32"
    assert {x.dtype for x in jax.tree.leaves(upcast.params)} == {jnp.dtype(jnp.float32)}


def test_existing_path_needs_overwrite(tiny_hf, tmp_path) -> None:
    first, second = _model(tiny_hf, "llama3", 0), _model(tiny_hf, "llama3", 1)
    path = save_model(first, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        save_model(second, path)
    assert params_equal(load_model(path).params, first.params)
    save_model(second, path, overwrite=True)
    assert params_equal(load_model(path).params, second.params)
    assert _siblings(path) == ["ckpt"]  # no temporary or old copies left behind


def test_failed_save_leaves_nothing(tiny_hf, tmp_path, monkeypatch) -> None:
    model = _model(tiny_hf, "qwen3", 0)

    def broken_save(self, directory, *args, **kwargs):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "partial").write_text("half")
        raise RuntimeError("disk full")

    path = tmp_path / "ckpt"
    with monkeypatch.context() as m:
        m.setattr(ocp.Checkpointer, "save", broken_save)
        with pytest.raises(RuntimeError, match="disk full"):
            save_model(model, path)
    assert not path.exists() and _siblings(path) == []
    # a failed overwrite keeps the old checkpoint intact
    save_model(model, path)
    with monkeypatch.context() as m:
        m.setattr(ocp.Checkpointer, "save", broken_save)
        with pytest.raises(RuntimeError, match="disk full"):
            save_model(_model(tiny_hf, "qwen3", 1), path, overwrite=True)
    assert _siblings(path) == ["ckpt"] and params_equal(load_model(path).params, model.params)


def test_params_must_match_config(tiny_hf, tmp_path) -> None:
    """Checked before anything is written, so a saved checkpoint always loads."""
    model = _model(tiny_hf, "qwen3")
    layer = model.params["layers_0"]
    bad = {**model.params, "norm": {"scale": object()}, "extra": {"w": jnp.ones(3)},
           "layers_0": {**layer, "mlp": {**layer["mlp"], "up_proj": {"kernel": jnp.ones((64, 7))}}}}
    bad.pop("layers_1")
    with pytest.raises(ConfigError, match="params do not fit the config .*: missing layers_1/"):
        Model(model.config, bad)  # refused where the model is made
    replaced = Model(model.config, model.params)
    replaced.params = bad  # and where params were swapped in after it, by the save
    with pytest.raises(CheckpointError) as info:
        save_model(replaced, tmp_path / "ckpt")
    for fact in ["missing layers_1/", "unexpected extra/w", "layers_0/mlp/up_proj/kernel: expected float32[64, 128], "
                 "got float32[64, 7]", "norm/scale: expected float32[64], got object[]"]:
        assert fact in str(info.value)
    assert _siblings(tmp_path / "ckpt") == []
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params)  # dtype must match the config too
    with pytest.raises(CheckpointError, match="expected float32"):
        save_model(Model(model.config, cast), tmp_path / "ckpt")


def test_not_a_model_folder(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="empty folder"):
        load_model(tmp_path)
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"not a model folder: expected either a Hugging Face folder .*"
                                              r"or a parse-jax checkpoint.*weights.npz"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="model path not found"):
        load_model(tmp_path / "missing")


def test_damaged_checkpoints(tiny_hf, tmp_path) -> None:
    model = _model(tiny_hf, "llama3", 1, tokenizer=False)
    path = save_model(model, tmp_path / "ckpt")
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps({**config, "intermediate_size": 64, "dtype": "bfloat16"}))
    fact = r"do not match.*layers_0/mlp/up_proj/kernel: expected bfloat16\[64, 64\], got float32\[64, 128\]"
    with pytest.raises(CheckpointError, match=fact):
        load_model(path)
    (path / CONFIG_FILE).write_text(json.dumps({**config, "colour": "blue"}))
    with pytest.raises(ConfigError, match="colour"):
        load_model(path)
    (path / CONFIG_FILE).write_text("{")
    with pytest.raises(ConfigError, match=CONFIG_FILE):
        load_model(path)
    (path / CONFIG_FILE).write_text(json.dumps(config))
    assert params_equal(load_model(path).params, model.params)
    shutil.rmtree(path / PARAMS_DIR)
    with pytest.raises(CheckpointError, match=f"no {PARAMS_DIR}/"):
        load_model(path)


def test_damaged_orbax_metadata(tiny_hf, tmp_path) -> None:
    path = save_model(_model(tiny_hf, "qwen3", 1, tokenizer=False), tmp_path / "ckpt")
    # (damaging Orbax's TensorStore files instead gives the same error, plus asyncio noise from Orbax's threads)
    (path / PARAMS_DIR / "_METADATA").write_text("{garbage")
    with pytest.raises(CheckpointError, match="holds no readable Orbax metadata"):
        load_model(path)


def test_non_finite_params_in_checkpoint(tiny_hf, tmp_path) -> None:
    model = _model(tiny_hf, "qwen2", 1, tokenizer=False)
    params = jax.tree.map(lambda x: x, model.params)
    params["layers_1"]["mlp"]["up_proj"]["kernel"] = params["layers_1"]["mlp"]["up_proj"]["kernel"].at[0, 0].set(
        jnp.nan)
    path = save_model(Model(model.config, params), tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"non-finite.*layers_1.*up_proj.*kernel"):
        load_model(path)
    assert params_equal(load_model(path, check_finite=False).params, params)


def test_relative_paths_load(tiny_hf, tmp_path, monkeypatch):
    from parse_jax import load_model as load
    from parse_jax import save_model as save

    model = load(tiny_hf("qwen3"))
    monkeypatch.chdir(tmp_path)
    save(model, "rel/ckpt")
    again = load("rel/ckpt")
    ids = [[1, 2, 3, 4]]
    assert (again.logits(ids) == model.logits(ids)).all()
