"""Logits of HF checkpoints loaded into the Flax decoder match PyTorch `transformers` (float32, 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

from parse_jax.checkpoints.load import load_model
from tests.models.hf_tiny import FAMILIES, VOCAB, hf_logits, hf_model


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_hf, family: str, seed: int) -> None:
    folder = tiny_hf(family, seed=seed)
    model = load_model(folder)
    assert model.config.dtype == "float32"
    ids = np.random.default_rng(seed + 10).integers(0, VOCAB, size=(2, 40))
    ours = model.logits(ids)
    ref = hf_logits(hf_model(folder), ids)
    assert ours.shape == ref.shape == (2, 40, VOCAB)
    assert np.abs(ref).max() > 1.0  # randomized weights give non-trivial logits
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_families_exercise_their_features(tiny_hf) -> None:
    """The fixtures really contain what the parity tests are meant to cover."""
    llama = load_model(tiny_hf("llama3")).config
    assert llama.rope_type == "llama3" and llama.rope_scaling[3] == 32 and not llama.tie_word_embeddings
    qwen2 = load_model(tiny_hf("qwen2")).config
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.num_heads // qwen2.num_kv_heads == 4
    qwen3 = load_model(tiny_hf("qwen3")).config
    assert qwen3.qk_norm and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size
