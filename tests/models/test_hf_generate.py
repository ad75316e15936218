"""32 greedy tokens from our jitted loop equal transformers' greedy `generate`, for each family."""

import numpy as np
import pytest
import torch

from parse_jax import generate, load_model
from tests.models.hf_tiny import hf_model


@pytest.mark.parametrize("family,seed", [("llama3", 0), ("qwen2", 1), ("qwen3", 2)])
def test_greedy_generation_equals_transformers(tiny_hf, family, seed):
    folder = tiny_hf(family, seed=seed)
    ours = load_model(folder)
    theirs = hf_model(folder)
    theirs.generation_config.eos_token_id = None
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, ours.config.vocab_size, n).tolist() for n in (7, 12)]
    res = generate(ours, prompts, max_new_tokens=32, eos_ids=[])
    for prompt, tokens in zip(prompts, res.tokens):
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert tokens == out[0, len(prompt):].tolist()
