"""Continuous batching of multi-round PARSE: slots refilled as rows finish give every prompt the tokens it gets alone
(greedy, float32), in prompt order, with mixed prompt lengths, budgets and EOS, and no compile per prompt."""

import dataclasses

import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.modes.parse_multi import serve_multi
from parse_jax.runtime.decode import generate
from parse_jax.runtime.programs import compiled_programs, setup_events
from parse_jax.runtime.slots import admission_warm_up
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import random_model

TOK = Tokenizer.from_folder(TOKENIZER_DIR)
V = TOK.vocab_size
TARGET = Model(random_model("qwen3", 60, vocab_size=V).config, random_model("qwen3", 60, vocab_size=V).params, TOK)
DRAFT = Model(random_model("llama3", 61, vocab_size=V).config, random_model("llama3", 61, vocab_size=V).params, TOK)
SETTINGS = dict(rounds="multi", schedule="fixed", segmenter="hybrid", min_segment=2, max_segment=5,
                max_draft_tokens=12, max_prefixes=4, delimiter=")")


def _prompts(n: int, seed: int) -> list[str]:
    """Arithmetic prompts of mixed lengths (one or two terms: one prompt bucket, so few programs compile)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        terms = [f"( {rng.integers(1, 9)} + {rng.integers(1, 9)} )" for _ in range(int(rng.integers(1, 3)))]
        out.append(" * ".join(terms) + " :")
    return out


PROMPTS = _prompts(8, 1)
BUDGETS = [6, 14, 14, 6, 14, 6, 14, 14]  # two budgets of one output bucket


def partial_engine(settings: dict) -> ParseEngine:
    """An engine whose threshold accepts drafts part-way on these random models (both verification outcomes)."""
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**settings))
    drafts = generate(DRAFT, PROMPTS[:4], max_new_tokens=12).tokens
    ids = [eng.target.tokenizer.encode(p) for p in PROMPTS[:4]]
    scores = np.concatenate([eng.prefix_scores(c, d, eng.boundaries(d)) for c, d in zip(ids, drafts)])
    return ParseEngine(TARGET, DRAFT, ParseConfig(**settings, threshold=float(np.quantile(scores, 0.4))))


@pytest.fixture(scope="module")
def engine() -> ParseEngine:
    """A threshold at which drafts are accepted part-way on these random models, so rows take several rounds."""
    return partial_engine(SETTINGS)


@pytest.fixture(scope="module")
def eos() -> int:
    """A stop id the target writes often, so that some rows end early at an EOS and free their slot."""
    plain = generate(TARGET, PROMPTS, max_new_tokens=14, eos_ids=[]).tokens
    return int(np.argmax(np.bincount([t for toks in plain for t in toks], minlength=V)))


@pytest.fixture(scope="module")
def alone(engine, eos) -> list:
    """Each prompt run alone (one multi-round program per prompt)."""
    return [engine.generate([p], mode="parse", max_new_tokens=b, eos_ids=[eos]) for p, b in zip(PROMPTS, BUDGETS)]


def test_refilled_slots_equal_each_prompt_alone_with_budgets_and_eos(engine, eos, alone):
    assert any(len(r.tokens[0]) < b for r, b in zip(alone, BUDGETS))  # EOS ended some rows before their budget
    assert any(r.stats["rounds"] > 1 for r in alone)  # and some rows took more than one round
    req = engine.request(PROMPTS, "parse", max(BUDGETS), 0.0, 0, 0, 1.0, [eos])
    with admission_warm_up():  # the first call also admits every size empty (what a benchmark's runs do)
        res = serve_multi(engine.context, req, 3, budgets=BUDGETS)
    assert res.tokens == [r.tokens[0] for r in alone]
    again = serve_multi(engine.context, req, 3, budgets=BUDGETS)  # no warm-up admissions now: none were counted
    assert (again.stats["target_passes"], again.stats["admissions"]) == (res.stats["target_passes"],
                                                                        res.stats["admissions"])
    assert res.stats["accepted_per_request"] == [r.stats["accepted_tokens"] for r in alone]
    assert res.stats["slots"] == 3 and res.stats["admissions"] > 1  # prompts entered slots freed by others


def test_generate_with_max_batch_serves_multi_round_parse(engine, eos, alone):
    rows = [i for i, b in enumerate(BUDGETS) if b == 14]
    prompts = [PROMPTS[i] for i in rows]
    res = engine.generate(prompts, mode="parse", max_new_tokens=14, eos_ids=[eos], max_batch=2)
    assert res.tokens == [alone[i].tokens[0] for i in rows]
    assert res.stats["slots"] == 2
    # no program per prompt: twice the prompts, in another order, compile at most the admission sizes not yet met
    before = compiled_programs()
    engine.generate((prompts + prompts)[::-1], mode="parse", max_new_tokens=14, eos_ids=[eos], max_batch=2)
    assert compiled_programs() - before <= 1
    before = setup_events()  # the same call again runs ready programs only: nothing traced, lowered or compiled
    engine.generate((prompts + prompts)[::-1], mode="parse", max_new_tokens=14, eos_ids=[eos], max_batch=2)
    assert setup_events() == before


def test_single_round_serves_through_slots_too(engine):
    eng = ParseEngine(TARGET, DRAFT, dataclasses.replace(engine.config, rounds="single"))
    prompts = PROMPTS[:4]
    res = eng.generate(prompts, mode="parse", max_new_tokens=6, max_batch=2)
    assert res.stats["slots"] == 2 and res.stats["admissions"] >= 2
    assert res.tokens == [eng.generate([p], mode="parse", max_new_tokens=6).tokens[0] for p in prompts]


@pytest.mark.parametrize("threshold", [0.0, None])
def test_caches_sized_for_real_tokens_write_what_roomy_ones_write(engine, threshold, monkeypatch):
    """Multi-round caches hold a block's real tokens, not its padding (`verify/round.later_block_reach`): at a
    threshold that accepts every draft whole (the longest blocks, rows running to their budgets' ends) and at one
    that accepts part-way, each prompt alone and served gives the tokens and acceptances a cache 256 positions
    larger gives."""
    import parse_jax.modes.parse_multi as multi

    eng = engine if threshold is None else ParseEngine(TARGET, DRAFT, ParseConfig(**SETTINGS, threshold=threshold))

    def run():
        alone = [eng.generate([p], mode="parse", max_new_tokens=b) for p, b in zip(PROMPTS[:4], BUDGETS[:4])]
        req = eng.request(PROMPTS, "parse", max(BUDGETS), 0.0, 0, 0, 1.0, None)
        served = serve_multi(eng.context, req, 3, budgets=BUDGETS)
        return ([r.tokens[0] for r in alone], [r.stats["accepted_tokens"] for r in alone], served.tokens,
                served.stats["accepted_per_request"])

    tight = run()
    reach = multi.later_block_reach
    monkeypatch.setattr(multi, "later_block_reach", lambda *a: reach(*a) + 256)
    assert multi.multi_shape(eng.context, 16, 14).cache_len > 256
    assert run() == tight
