"""Models as shapes: the shipped configs match their published sizes; a folder's own tokenizer is used."""

import jax
import pytest

from parse_jax.checkpoints.pair import PAIR_DIR
from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.lowering.sources import shape_head, shape_model, shape_pair, shipped_configs
from parse_jax.models.config import read_hf_config
from parse_jax.utils.paths import config_dir


@pytest.mark.parametrize("name,params", [("qwen3-8b", 8.19e9), ("qwen3-0.6b", 0.596e9), ("llama3-8b", 8.03e9),
                                         ("llama3-1b", 1.24e9)])
def test_shipped_configs_have_their_published_sizes(name, params):
    cfg = read_hf_config(config_dir() / "models" / f"{name}.json")
    assert cfg.num_params == pytest.approx(params, rel=0.005)
    assert (cfg.dtype, cfg.head_dim) == ("bfloat16", 128 if name != "llama3-1b" else 64)


def test_a_shape_model_holds_shapes_not_arrays():
    model = shape_model("llama3-1b")
    leaf = model.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert leaf.shape == (model.config.hidden_size, model.config.num_heads * model.config.head_dim)
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.dtype == "bfloat16"


def test_the_embedded_pair_as_shapes_keeps_its_tokenizer_and_dtype():
    target, draft = shape_pair()
    assert target.tokenizer.vocab_size <= target.config.vocab_size
    assert (target.config.dtype, draft.config.vocab_size) == ("bfloat16", target.config.vocab_size)
    assert shape_model(PAIR_DIR / "target", dtype="float32").config.dtype == "float32"
    head = shape_head(target.config)
    assert head.config.target_layers == target.config.num_layers


def test_bad_sources_are_one_line_errors(tmp_path):
    assert "qwen3-8b" in shipped_configs()
    with pytest.raises(ConfigError, match="neither a folder, a config.json file nor a shipped config"):
        shape_model(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="holds no model config"):
        shape_model(tmp_path)
    with pytest.raises(CheckpointError, match="is not a pair folder: no target/ or draft/"):
        shape_pair(tmp_path)
