"""Sampled generation is per request: each prompt draws from its own seed (a call's `seed` + its index, or its own in
a list), folded with its own counters only, and writes its own budget (`max_new_tokens` one per prompt), so in every
mode its tokens are those it gets alone, whatever batch, batching (fixed or continuous), slot count or neighbours it
runs with."""

import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import InputError
from parse_jax.runtime.decode import generate
from tests.modes.test_parse_multi_eagle3 import DRAFT, HEAD, PROMPTS, SETTINGS, TARGET

SEED = 40
MODES = [("target", "single"), ("sd", "single"), ("eagle3", "single"), ("parse", "single"), ("sequential", "single"),
         ("parse+eagle3", "single"), ("parse", "multi"), ("parse+eagle3", "multi")]


@pytest.fixture(scope="module")
def threshold() -> float:
    """A threshold at which drafts are accepted part-way on these random models (both verification outcomes)."""
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**SETTINGS), eagle3=HEAD)
    drafts = generate(DRAFT, PROMPTS, max_new_tokens=10, temperature=1.0, seed=3).tokens
    ids = [eng.target.tokenizer.encode(p) for p in PROMPTS]
    scores = np.concatenate([eng.prefix_scores(c, d, eng.boundaries(d)) for c, d in zip(ids, drafts)])
    return float(np.quantile(scores, 0.4))


@pytest.mark.parametrize("mode,rounds", MODES)
def test_a_sampled_prompt_gets_its_own_tokens_and_budget_in_any_batch(mode, rounds, threshold):
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**{**SETTINGS, "rounds": rounds}, threshold=threshold),
                      eagle3=HEAD)
    kw = dict(mode=mode, temperature=1.0, top_k=20, eos_ids=[])  # no stop id: every row writes its whole budget
    budgets = [12, 5, 9]
    fixed = eng.generate(PROMPTS, seed=SEED, max_new_tokens=budgets, **kw)
    assert [len(t) for t in fixed.tokens] == budgets
    # the prompts in reverse through 2 slots (served: a finished row's slot takes the next prompt), each keeping
    # its seed and budget through per-prompt lists
    seeds = [SEED + i for i in range(len(PROMPTS))]
    served = eng.generate(PROMPTS[::-1], seed=seeds[::-1], max_new_tokens=budgets[::-1], max_batch=2, **kw)
    assert served.stats["slots"] == 2
    assert served.tokens[::-1] == fixed.tokens
    alone = eng.generate(PROMPTS[1:2], seed=SEED + 1, max_new_tokens=budgets[1], **kw)
    assert alone.tokens[0] == fixed.tokens[1]
    # the draws are real: another seed, other tokens
    assert eng.generate(PROMPTS, seed=SEED + 7, max_new_tokens=budgets, **kw).tokens != fixed.tokens


def test_a_seed_or_budget_list_must_name_one_per_prompt():
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**SETTINGS), eagle3=HEAD)
    with pytest.raises(InputError, match="seed: 2 seeds for 3 prompts"):
        eng.generate(PROMPTS, mode="target", temperature=1.0, seed=[1, 2], max_new_tokens=4)
    with pytest.raises(InputError, match="max_new_tokens: 2 budgets for 3 prompts"):
        eng.generate(PROMPTS, mode="sd", max_new_tokens=[4, 5])
    with pytest.raises(InputError, match=r"max_new_tokens\[1\] must be an integer >= 1, got a list"):
        eng.generate(PROMPTS[:2], mode="sd", max_new_tokens=[4, [5]])
    with pytest.raises(InputError, match=r"max_new_tokens\[1\]"):
        generate(TARGET, PROMPTS[:2], max_new_tokens=[4, 0])
    # each prompt fits the positions with its own budget: a long prompt with a short one beside a short prompt with
    # a long one runs (512 positions), in every mode's check
    long, short = list(range(4, 14)) * 49, [5, 6, 7]
    for mode in ("target", "sd", "parse"):
        res = eng.generate([long, short], mode=mode, max_new_tokens=[2, 30], eos_ids=[])
        assert [len(t) for t in res.tokens] == [2, 30], mode
    with pytest.raises(InputError, match="prompt 0 has 490 tokens; mode sd with max_new_tokens=30"):
        eng.generate([long, short], mode="sd", max_new_tokens=[30, 2])
