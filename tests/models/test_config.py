"""HF config translation: each family's fields, and clear refusals."""

import jax
import pytest

from parse_jax.errors import ConfigError
from parse_jax.models.config import ModelConfig, config_from_hf
from parse_jax.models.model import expected_params
from tests.random_models import FAMILIES, tiny_config

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100}


def test_family_details_come_from_the_model_type():
    llama = config_from_hf({**BASE, "model_type": "llama", "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "rope_theta": 500000.0, "eos_token_id": [7, 9]})
    assert llama.rope_type == "llama3" and llama.rope_scaling == (8.0, 1.0, 4.0, 8192.0)
    assert llama.rope_theta == 500000.0 and llama.eos_token_ids == (7, 9) and not llama.qkv_bias
    qwen2 = config_from_hf({**BASE, "model_type": "qwen2", "tie_word_embeddings": True})
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm
    qwen3 = config_from_hf({**BASE, "model_type": "qwen3", "head_dim": 32,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.rope_theta == 1e6 and not qwen3.qkv_bias
    assert ModelConfig.from_dict(qwen3.to_dict()) == qwen3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_num_params_counts_every_tensor(family):
    cfg = tiny_config(family)
    assert cfg.num_params == sum(x.size for x in jax.tree.leaves(expected_params(cfg)))


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unknown architecture"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
    ({"model_type": "llama", "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"model_type": "llama", "hidden_size": None}, "hidden_size"),
])
def test_unusable_configs_are_refused_by_name(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**BASE, **change})


def test_missing_field_is_named():
    d = {k: v for k, v in BASE.items() if k != "vocab_size"}
    with pytest.raises(ConfigError, match="vocab_size"):
        config_from_hf({**d, "model_type": "llama"})


LLAMA = {**BASE, "model_type": "llama"}


@pytest.mark.parametrize("change,message", [
    ({"rope_theta": -10000.0}, r"'rope_theta' must lie in \(0, inf\), got -10000"),
    ({"rope_theta": float("nan")}, r"'rope_theta' must be a finite number, got nan"),
    ({"rope_theta": 0}, r"'rope_theta' must lie in \(0, inf\), got 0"),
    ({"rms_norm_eps": -1}, r"'rms_norm_eps' must lie in \(0, inf\), got -1"),
    ({"rms_norm_eps": 0.0}, r"'rms_norm_eps' must lie in \(0, inf\), got 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, r"rope_scaling \(linear\) field 'factor' must lie in "
                                                            r"\(0, inf\), got 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 16}},
     r"rope_scaling \(yarn\) field 'factor' must lie in \(0, inf\), got -2"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 64}}, "'high_freq_factor' .* greater than 'low_freq"),
    ({"num_hidden_layers": 7.9}, r"'num_hidden_layers' must be an integer, got 7.9"),
    ({"num_hidden_layers": True}, r"'num_hidden_layers' must be an integer, got True"),
    ({"num_hidden_layers": "2"}, r"'num_hidden_layers' must be an integer, got '2'"),
    ({"num_hidden_layers": 0}, r"'num_hidden_layers' must be >= 1, got 0"),
    ({"num_attention_heads": 0}, r"'num_attention_heads' must be >= 1, got 0"),
    ({"hidden_size": 64.5}, r"'hidden_size' must be an integer, got 64.5"),
    ({"vocab_size": -5}, r"'vocab_size' must be >= 1, got -5"),
    ({"bos_token_id": 100}, r"'bos_token_id' is 100, outside the vocabulary: allowed 0\.\.99"),
    ({"eos_token_id": [2, 150]}, r"'eos_token_id' is 150, outside the vocabulary: allowed 0\.\.99"),
    ({"eos_token_id": -1}, r"'eos_token_id' must be >= 0, got -1"),
    ({"eos_token_id": 2.5}, r"'eos_token_id' must be an integer, got 2.5"),
    ({"max_position_embeddings": 0}, r"'max_position_embeddings' must be >= 1, got 0"),
])
def test_bad_numbers_are_refused_with_field_value_and_range(change, message):
    with pytest.raises(ConfigError, match=message) as info:
        config_from_hf({**LLAMA, **change})
    assert "\n" not in str(info.value)


def test_integral_floats_are_accepted():
    """8.0 from a YAML/JSON writer is an integer; only a fractional part or a bool is refused."""
    assert config_from_hf({**LLAMA, "num_hidden_layers": 2.0}).num_layers == 2


@pytest.mark.parametrize("field,value,message", [
    ("rope_theta", -1.0, "rope_theta"), ("rms_norm_eps", float("nan"), "rms_norm_eps"),
    ("num_layers", True, "num_layers"), ("bos_token_id", 100, "bos_token_id"),
    ("eos_token_ids", (1, 100), "eos_token_ids"), ("vocab_limit", 101, "vocab_limit"),
])
def test_model_config_checks_its_own_fields(field, value, message):
    cfg = config_from_hf(LLAMA)
    with pytest.raises(ConfigError, match=message):
        cfg.replace(**{field: value})
