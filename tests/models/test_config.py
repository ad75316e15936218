"""HF config translation: each family's fields, and clear refusals."""

import jax
import pytest

from parse_jax.errors import ConfigError
from parse_jax.models.config import ModelConfig, config_from_hf
from parse_jax.models.hf_import import expected_params
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
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
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
