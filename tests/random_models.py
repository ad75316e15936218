"""Tiny random models of each family, with every parameter perturbed so norm and bias bugs show."""

from __future__ import annotations

import jax
import numpy as np

from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model, init_params

FAMILIES = {
    "llama3": dict(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rope_type="llama3",
                   rope_scaling=(8.0, 1.0, 4.0, 32.0), rope_theta=500000.0),
    "qwen2": dict(architecture="qwen2", vocab_size=89, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True),
    "qwen3": dict(architecture="qwen3", vocab_size=103, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True),
}


def tiny_config(family: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**FAMILIES[family], "max_position_embeddings": 512, **overrides})


def random_model(family: str, seed: int = 0, **overrides) -> Model:
    cfg = tiny_config(family, **overrides)
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1000)
    leaves, treedef = jax.tree.flatten(params)
    noisy = [np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.asarray(x).dtype) for x in leaves]
    return Model(cfg, jax.tree.unflatten(treedef, noisy))
