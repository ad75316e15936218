"""HF import: sharded and bf16/fp16 checkpoints, and one clear error per kind of bad folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from parse_jax.checkpoints.hf import INDEX_FILE, SINGLE_FILE, export_hf, load_hf
from parse_jax.checkpoints.load import load_model
from parse_jax.checkpoints.orbax import params_equal
from parse_jax.errors import CheckpointError, ConfigError
from tests.models.hf_tiny import TOKENIZER_VOCAB, VOCAB, hf_logits, hf_model

IDS = np.random.default_rng(7).integers(0, VOCAB, size=(2, 24))


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder: Path, edit) -> None:
    """Rewrite model.safetensors after `edit(dict_of_numpy)` mutates it in place."""
    tensors = safetensors.numpy.load_file(str(folder / SINGLE_FILE))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_sharded_loads_like_single_file(tiny_hf) -> None:
    sharded = tiny_hf("qwen3", sharded=True)
    assert (sharded / INDEX_FILE).is_file() and not (sharded / SINGLE_FILE).exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, b = load_hf(sharded), load_hf(tiny_hf("qwen3"))
    assert params_equal(a.params, b.params)
    assert not params_equal(a.params, load_hf(tiny_hf("qwen3", seed=1)).params)


def test_bfloat16_checkpoint(tiny_hf) -> None:
    folder = tiny_hf("llama3", dtype="bfloat16")
    model = load_hf(folder)
    assert model.config.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    # the same weights rounded by torch equal ours rounded by ml_dtypes, bit for bit
    f32 = load_hf(tiny_hf("llama3"))
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16), f32.params)
    assert params_equal(model.params, rounded)
    # upcast on load: exact bf16 values in float32, same logits as torch running the bf16 weights in float32
    up = load_hf(folder, dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(up.params)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(up.logits(IDS), hf_logits(hf_model(folder), IDS), atol=1e-4, rtol=0)
    assert np.abs(model.logits(IDS) - up.logits(IDS)).max() < 0.25  # bf16 compute stays close


def test_float16_checkpoint_loads_as_float32(tiny_hf) -> None:
    folder = tiny_hf("qwen2", dtype="float16")
    model = load_hf(folder)
    assert model.config.dtype == "float32"
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf_model(folder), IDS), atol=1e-4, rtol=0)
    assert load_hf(folder, dtype="bfloat16").config.dtype == "bfloat16"


def test_mismatches_are_all_listed(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("llama3"), tmp_path)

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"], t["model.norm.weight"]
        t["model.layers.2.mlp.up_proj.weight"] = np.ones((128, 64), np.float32)
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
        t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"].astype(np.int8)
        t["model.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # a buffer some exporters store: ignored
    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError) as info:
        load_hf(folder)
    msg = str(info.value)
    assert "missing tensors (2): model.layers.1.mlp.up_proj.weight; model.norm.weight" in msg
    assert "unexpected tensors (1): model.layers.2.mlp.up_proj.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight: expected [32, 64], found F32[16, 64]" in msg
    assert "model.layers.0.mlp.gate_proj.weight: I8[128, 64]" in msg
    assert "inv_freq" not in msg


def test_untied_model_needs_lm_head(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("qwen3"), tmp_path)
    _edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): lm_head.weight"):
        load_hf(folder)


def test_tied_model_with_stored_lm_head(tiny_hf, tmp_path) -> None:
    """As transformers 5: an equal copy is dropped, a lone copy is the embedding, a different one unties."""
    src = tiny_hf("qwen2")
    reference = load_hf(src).logits(IDS)
    folder = _copy(src, tmp_path)
    embed = "model.embed_tokens.weight"
    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": t[embed].copy()}))
    model = load_hf(folder)
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    np.testing.assert_array_equal(model.logits(IDS), reference)

    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": t.pop(embed)}))
    model = load_hf(folder)
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    np.testing.assert_array_equal(model.logits(IDS), reference)

    rng = np.random.default_rng(0)
    _edit_tensors(folder, lambda t: t.update({embed: rng.normal(size=(VOCAB, 64)).astype(np.float32)}))
    with pytest.warns(UserWarning, match="untied"):
        model = load_hf(folder)
    assert not model.config.tie_word_embeddings and "lm_head" in model.params
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf_model(folder), IDS), atol=1e-4, rtol=0)

    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": np.ones((VOCAB, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=r"lm_head.weight: expected \[320, 64\], found F32\[320, 32\]"):
        with pytest.warns(UserWarning, match="untied"):
            load_hf(folder)


def test_non_finite_weights(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("qwen2"), tmp_path)

    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"][3, 5] = np.nan
        t["model.layers.1.self_attn.q_proj.bias"][0] = np.inf
    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError, match="non-finite") as info:
        load_hf(folder)
    assert "model.layers.0.mlp.down_proj.weight" in str(info.value)
    assert "model.layers.1.self_attn.q_proj.bias" in str(info.value)
    model = load_hf(folder, check_finite=False)
    assert np.isnan(np.asarray(model.params["layers_0"]["mlp"]["down_proj"]["kernel"])[5, 3])
    assert np.isnan(model.logits(IDS)).any()


def test_non_finite_bfloat16_weight(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("llama3", dtype="bfloat16"), tmp_path)
    header = json.loads(_raw_header(folder / SINGLE_FILE))
    name = "model.layers.1.post_attention_layernorm.weight"
    assert header[name]["dtype"] == "BF16"
    data = bytearray((folder / SINGLE_FILE).read_bytes())
    start = 8 + len(_raw_header(folder / SINGLE_FILE)) + header[name]["data_offsets"][0]
    data[start:start + 2] = np.array([np.inf], ml_dtypes.bfloat16).tobytes()
    (folder / SINGLE_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=name):
        load_hf(folder)
    assert load_hf(folder, check_finite=False).config.dtype == "bfloat16"


def _raw_header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[8:8 + int.from_bytes(data[:8], "little")]


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_corrupt_safetensors(tiny_hf, tmp_path, damage: str) -> None:
    folder = _copy(tiny_hf("qwen3"), tmp_path)
    path = folder / SINGLE_FILE
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:len(data) // 2], "garbage_header": b"\xff" * 8 + data[8:],
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=f"corrupt or truncated safetensors file .*{SINGLE_FILE}"):
        load_hf(folder)


def test_missing_files(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("qwen3"), tmp_path)
    (folder / SINGLE_FILE).rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json.*pytorch_model"):
        load_hf(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match=f"config.json not found: {folder / 'config.json'}"):
        load_hf(folder)
    with pytest.raises(CheckpointError, match="model folder not found"):
        load_hf(tmp_path / "nowhere")


def test_missing_shard(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("qwen3", sharded=True), tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{shard.name}"):
        load_hf(folder)


def test_missing_tokenizer(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("qwen3"), tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=f"tokenizer.json not found: {folder / 'tokenizer.json'}"):
        load_hf(folder)


def test_unknown_architecture(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("qwen3"), tmp_path)
    _edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="gpt2.*GPT2LMHeadModel"):
        load_model(folder)


def test_tokenizer_larger_than_embedding(tiny_hf, tmp_path) -> None:
    folder = _copy(tiny_hf("qwen3"), tmp_path)
    _edit_config(folder, vocab_size=TOKENIZER_VOCAB - 10)
    with pytest.raises(CheckpointError, match=f"tokenizer vocabulary \\({TOKENIZER_VOCAB} tokens.*\\(290 rows\\)"):
        load_hf(folder)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_export_round_trip(tiny_hf, tmp_path, family: str) -> None:
    """export_hf writes a folder both load_hf and transformers read back to the same model."""
    model = load_hf(tiny_hf(family, seed=1))
    out = export_hf(model, tmp_path / "exported")
    back = load_hf(out)
    assert back.config == model.config and params_equal(back.params, model.params)
    assert back.tokenizer.encode("hello world") == model.tokenizer.encode("hello world")
    np.testing.assert_allclose(hf_logits(hf_model(out), IDS), model.logits(IDS), atol=1e-4, rtol=0)
    bf16 = load_hf(export_hf(model, tmp_path / "bf16", dtype="bfloat16"))
    assert bf16.config.dtype == "bfloat16"
    assert params_equal(bf16.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params))


def test_a_training_runs_step_exported_from_the_command_line_loads_in_transformers(tmp_path, capsys, monkeypatch):
    """`parse-jax export --model RUN --step N --out DIR`: transformers reads the step's weights (same logits as
    parse-jax's of that step); an existing --out is refused unless --overwrite; a write that fails leaves nothing
    under the final name."""
    from parse_jax.cli import main
    from parse_jax.models.model import Model
    from parse_jax.models.tokenizer import Tokenizer
    from parse_jax.tasks import TOKENIZER_DIR
    from tests.checkpoints.runs_fixture import write_run
    from tests.random_models import random_model

    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    m = random_model("qwen3", 7, vocab_size=tok.vocab_size)
    write_run(tmp_path / "run", Model(m.config, m.params, tok), steps=(10, 20), run_json=True)
    out = tmp_path / "hf"
    assert main(["export", "--model", str(tmp_path / "run"), "--step", "10", "--out", str(out), "-q"]) == 0
    ids = np.array([tok.encode("( 1 + 2 ) * 3 :")])
    step10 = load_model(tmp_path / "run", step=10)
    np.testing.assert_allclose(hf_logits(hf_model(out), ids), step10.logits(ids), atol=1e-4, rtol=0)
    assert main(["export", "--model", str(tmp_path / "run"), "--out", str(out), "-q"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", "--model", str(tmp_path / "run"), "--out", str(out), "--overwrite", "-q"]) == 0
    assert params_equal(load_hf(out).params, load_model(tmp_path / "run", step=20).params)  # the latest step
    # an --out that holds the source would be replaced whole: refused, the run untouched
    assert main(["export", "--model", str(tmp_path / "run"), "--out", str(tmp_path), "--overwrite", "-q"]) == 2
    assert "holds --model" in capsys.readouterr().err and (tmp_path / "run" / "run.json").is_file()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    assert main(["export", "--model", str(tmp_path / "run"), "--out", str(tmp_path / "hf2"), "-q"]) != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no hf2, no temporary
