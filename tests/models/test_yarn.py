"""yarn RoPE: inverse frequencies and attention factor as transformers computes them, and logits parity with
transformers (float32, 1e-4) for Qwen3 and Llama with positions past the original context."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from parse_jax.checkpoints.hf import export_hf
from parse_jax.checkpoints.load import load_model
from parse_jax.models.config import config_from_hf, rope_attention_scaling, rope_inv_freq
from tests.models.hf_tiny import VOCAB, hf_logits, hf_model, make_tiny_hf

YARN = {
    "qwen3": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    # mscale / mscale_all_dim (DeepSeek-style attention factor) and non-default betas
    "llama3": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 16,
               "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
}


@pytest.mark.parametrize("family", sorted(YARN))
def test_yarn_logits_match_transformers(tmp_path, family: str) -> None:
    folder = make_tiny_hf(family, tmp_path / family, seed=5, rope=YARN[family])
    model = load_model(folder)
    assert model.config.rope_type == "yarn" and rope_attention_scaling(model.config) != 1.0
    ref_model = hf_model(folder)
    rotary = ref_model.model.rotary_emb
    np.testing.assert_allclose(rope_inv_freq(model.config), rotary.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert rope_attention_scaling(model.config) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(2, 48))  # 48 positions > 16 original
    np.testing.assert_allclose(model.logits(ids), hf_logits(ref_model, ids), atol=1e-4, rtol=0)


def test_yarn_differs_from_plain_rope(tmp_path) -> None:
    """The parity above can fail: without yarn the same weights give other logits."""
    folder = make_tiny_hf("qwen3", tmp_path / "q", seed=5, rope=YARN["qwen3"])
    model = load_model(folder)
    plain = model.__class__(model.config.replace(rope_type="default", rope_scaling=()), model.params)
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(1, 48))
    assert np.abs(model.logits(ids) - plain.logits(ids)).max() > 1e-2


def test_yarn_export_round_trip(tmp_path) -> None:
    folder = make_tiny_hf("qwen3", tmp_path / "q", seed=5, rope=YARN["qwen3"])
    model = load_model(folder)
    out = export_hf(model, tmp_path / "out")
    assert load_model(out).config == model.config
    ids = np.random.default_rng(6).integers(0, VOCAB, size=(1, 40))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(model.logits(ids), hf_logits(back, ids), atol=1e-4, rtol=0)


def test_yarn_defaults_follow_transformers() -> None:
    """factor from max_position_embeddings / original when absent; original from max_position_embeddings."""
    base = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256}
    cfg = config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}})
    assert cfg.rope_scaling[:4] == (4.0, 64.0, 32.0, 1.0)
    cfg = config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5,
                                                   "truncate": False}})
    assert cfg.rope_scaling == (2.0, 256.0, 32.0, 1.0, 1.5, 0.0)


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it() -> None:
    """A transformers-5 config (`rope_parameters`) given the yarn `rope_scaling` of a model card: transformers reads
    `rope_scaling` alone (`rope_scaling or rope_parameters`); merged, its `type` lost to `rope_type: default`."""
    d = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
         "max_position_embeddings": 256, "rope_theta": 20000.0,
         "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    theirs = transformers.Qwen3Config(**d).rope_parameters
    ours = config_from_hf(d)
    assert theirs["rope_type"] == ours.rope_type == "yarn"
    assert ours.rope_theta == theirs["rope_theta"]
    assert ours.rope_scaling[:2] == (theirs["factor"], theirs["original_max_position_embeddings"])
