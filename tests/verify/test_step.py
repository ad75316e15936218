"""The target's step in multi-round PARSE ends where the delimiter automaton ends an occurrence, its state carried
from token to token: a delimiter that the tokenizer writes over two tokens ends the step (the round), not
`max_segment`; the output stays the target's own (threshold 1, greedy, float32), with and without EAGLE-3."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.modes.parse_multi import serve_multi
from parse_jax.runtime.decode import generate
from parse_jax.tasks import TOKENIZER_DIR
from parse_jax.verify.segment import DelimiterTable
from parse_jax.verify.step import cut_at_step_end
from tests.random_models import random_model
from tests.speculation.test_eagle3 import random_head

V = 27  # the embedded tokenizer's vocabulary: its ids 4..21 are digits and operators, 22..26 the suffix and judge
T = random_model("qwen3", 70, vocab_size=V)
D = random_model("llama3", 71, vocab_size=V)
PROMPTS = [[1, 17, 5, 14, 6, 18, 19], [1, 17, 9, 16, 8, 18, 15, 7, 19], [1, 12, 19]]  # mixed lengths
MAX_SEGMENT, MAX_NEW = 12, 30


def _split_pair() -> tuple[int, int]:
    """Two ids (a, b) that the target writes one after the other early in its answer to the first prompt, so that
    a delimiter written as a then b ends its first step well before max_segment."""
    out = generate(T, PROMPTS[:1], max_new_tokens=MAX_NEW, eos_ids=[]).tokens[0]
    for j in range(MAX_SEGMENT - 3):
        a, b = out[j], out[j + 1]
        if a != b and 4 <= a <= 21 and 4 <= b <= 21 and a not in out[:j]:
            return a, b
    raise AssertionError(f"no usable pair in the target's output {out}")


A, B = _split_pair()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """The embedded tokenizer (HF `tokenizers` WordLevel format) with token A written "<" and token B ">": the
    delimiter "<>" is then always written over two tokens, and no token holds it whole."""
    folder = tmp_path_factory.mktemp("split_tok")
    spec = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    names = {i: t for t, i in spec["model"]["vocab"].items()}
    names[A], names[B] = "<", ">"
    spec["model"]["vocab"] = {t: i for i, t in names.items()}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(TOKENIZER_DIR / "tokenizer_config.json", folder / "tokenizer_config.json")
    tok = Tokenizer.from_folder(folder)
    assert tok.token_texts[A] == "<" and tok.token_texts[B] == ">"
    return tok


def _engine(tok: Tokenizer, eagle: bool, delimiter: str = "<>") -> ParseEngine:
    target, draft = Model(T.config, T.params, tok), Model(D.config, D.params, tok)
    cfg = ParseConfig(rounds="multi", schedule="fixed", threshold=1.0, segmenter="delimiter", delimiter=delimiter,
                      max_segment=MAX_SEGMENT, max_draft_tokens=8, max_prefixes=4)
    return ParseEngine(target, draft, cfg, eagle3=random_head(target, 72) if eagle else None)


def _steps(tokens: list[int], table: np.ndarray | None, eos: set[int], budget: int) -> int:
    """Rounds of a threshold-1 multi-round run on the host: nothing is accepted, so each round is one target step,
    which ends after a delimiter occurrence (the automaton's state carried over the whole output), an EOS,
    max_segment tokens or the budget."""
    rounds, i, state = 0, 0, 0
    while i < len(tokens) and i < budget:
        rounds, k = rounds + 1, 0
        while i < len(tokens) and i < budget:
            tok = tokens[i]
            entry = 0 if table is None else int(table[state, tok])
            state, i, k = entry // 2, i + 1, k + 1
            if entry % 2 or tok in eos or k >= MAX_SEGMENT:
                break
    return rounds


def test_the_automaton_carries_its_state_across_tokens(tokenizer):
    table = DelimiterTable.from_texts(tokenizer.token_texts, ["<>"], V).table
    assert DelimiterTable(table).completing_ids().size == 0  # no single token ends a step: the old stop set is empty
    tokens = jnp.asarray([[7, A, B, 8, A, 9], [A, 7, 8, 9, 10, 11], [B, 7, 8, 9, 10, 11]], jnp.int32)
    count = jnp.asarray([6, 6, 6], jnp.int32)
    after_a = int(table[0, A]) // 2
    kept, state = cut_at_step_end(tokens, count, jnp.asarray(table), jnp.asarray([0, 0, after_a], jnp.int32))
    # row 0: "<" ">" ends at its third token; row 1: no ">" after "<"; row 2: "<" carried in from before its first token
    assert kept.tolist() == [3, 6, 1] and state.tolist()[0] == 0


@pytest.mark.parametrize("eagle", [False, True])
def test_a_delimiter_over_two_tokens_ends_the_targets_step(tokenizer, eagle):
    eng = _engine(tokenizer, eagle)
    eos = {int(x) for x in eng.request(PROMPTS, "target", MAX_NEW, 0.0, 0, 0, 1.0, None).eos}
    table = eng.delimiters.table
    mode = "parse+eagle3" if eagle else "parse"
    for prompts in (PROMPTS[:1], PROMPTS):
        alone = eng.generate(prompts, mode="target", max_new_tokens=MAX_NEW).tokens
        res = eng.generate(prompts, mode=mode, max_new_tokens=MAX_NEW)
        assert res.tokens == alone  # threshold 1: the target's own tokens
        assert res.stats["accepted_tokens"] == 0
        expect = [_steps(t, table, eos, MAX_NEW) for t in alone]
        assert res.stats["checks_per_request"] == expect  # one round per step, each ended where the delimiter ends
    # the delimiter is seen in the first prompt's answer: more rounds than max_segment alone would give
    assert expect[0] > _steps(alone[0], None, eos, MAX_NEW)


def test_served_split_delimiter_steps_equal_each_prompt_alone(tokenizer):
    eng = _engine(tokenizer, eagle=True)
    budgets = [MAX_NEW, 9, 20]
    req = eng.request(PROMPTS, "parse+eagle3", MAX_NEW, 0.0, 0, 0, 1.0, None)
    res = serve_multi(eng.context, req, 2, budgets=budgets, eagle=True)
    alone = [eng.generate([p], mode="parse+eagle3", max_new_tokens=b) for p, b in zip(PROMPTS, budgets)]
    assert res.tokens == [r.tokens[0] for r in alone]
    assert res.stats["checks_per_request"] == [r.stats["checks_per_request"][0] for r in alone]
