"""The embedded tokenizer: exact round trip, single-token judge words, no <unk>, shipped files up to date."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parse_jax.tasks import (
    DELIMITER,
    JUDGE_NO,
    JUDGE_YES,
    PRESETS,
    SPECIAL_TOKENS,
    SYMBOLS,
    TOKENIZER_DIR,
    VERIFY_SUFFIX,
    build_tokenizer,
    load_task,
    tokenizer_config,
    write_tokenizer,
)

TOK = build_tokenizer()
UNK = TOK.token_to_id("<unk>")


def _task_texts(name, seed, n=20):
    """Every kind of text the task writes: prompts, solutions in both orders, corruptions, verification prompts."""
    task = load_task(name)
    rng = random.Random(seed)
    out = []
    for prompt, ref in task.problems(n, seed, split="all"):
        sol = task.solve(prompt, rng)
        bad, idx = task.corrupt(prompt, sol, rng)
        steps = task.steps(sol)
        out += [prompt, ref, sol, bad, f"{prompt} {sol}", f"{prompt} {bad}"]
        for k in range(len(steps) + 1):
            v = task.verify_prompt(prompt, steps[:k])
            out += [v, f"{v} {JUDGE_YES}", f"{v} {JUDGE_NO}"]
        out.append(task.verify_prompt(prompt, task.steps(bad), task.final_answer(bad)) + f" {JUDGE_NO}")
    return out


def test_vocabulary():
    vocab = TOK.get_vocab()
    assert len(vocab) == TOK.get_vocab_size() < 64
    assert [TOK.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert TOK.token_to_id("<pad>") == 0
    assert set(vocab) == {*SPECIAL_TOKENS, *SYMBOLS}
    assert sorted(vocab.values()) == list(range(len(vocab)))
    for name in PRESETS:  # one tokenizer fits every config
        assert build_tokenizer(load_task(name)).to_str() == TOK.to_str()


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(sorted(PRESETS)), seed=st.integers(0, 2**32 - 1))
def test_round_trip_and_no_unk(name, seed):
    for text in _task_texts(name, seed):
        enc = TOK.encode(text, add_special_tokens=False)
        assert UNK not in enc.ids, text
        assert len(enc.ids) == len(text.split())
        assert TOK.decode(enc.ids) == text
        assert TOK.decode(TOK.encode(text).ids) == text  # default add_special_tokens adds nothing


def test_judge_words_and_delimiter_are_single_tokens():
    for word in (JUDGE_YES, JUDGE_NO, DELIMITER):
        ids = TOK.encode(word, add_special_tokens=False).ids
        assert len(ids) == 1 and ids[0] != UNK
        assert TOK.encode(" " + word, add_special_tokens=False).ids == ids
        assert TOK.encode(" " + word).ids == [TOK.token_to_id("<bos>"), *ids]  # the post-processor's BOS
    assert TOK.encode(JUDGE_YES).ids != TOK.encode(JUDGE_NO).ids
    suffix = TOK.encode(VERIFY_SUFFIX, add_special_tokens=False).ids
    assert len(suffix) == 2 and UNK not in suffix


def test_token_concatenation_matches_text_concatenation():
    """context ids + draft prefix ids + suffix ids (what the engine packs) == ids of the verification prompt."""
    task = load_task("hard")
    rng = random.Random(0)
    enc = lambda s: TOK.encode(s, add_special_tokens=False).ids  # noqa: E731
    for prompt, _ in task.problems(30, 4, split="all"):
        sol = task.solve(prompt, rng)
        steps = task.steps(sol)
        ids = enc(sol)
        delim = TOK.token_to_id(DELIMITER)
        cuts = [i + 1 for i, t in enumerate(ids) if t == delim]
        assert len(cuts) == len(steps)
        for k, cut in enumerate(cuts, start=1):
            assert enc(prompt) + ids[:cut] + enc(VERIFY_SUFFIX) == enc(task.verify_prompt(prompt, steps[:k]))
        assert enc(prompt) + ids == enc(f"{prompt} {sol}")


def test_shipped_files_are_up_to_date(tmp_path):
    out = write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (TOKENIZER_DIR / name).read_text() == (out / name).read_text(), (
            f"{name} is stale: run `python -m parse_jax.tasks`")
    cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert cfg == tokenizer_config()
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == SPECIAL_TOKENS[1:3] + (
        "<pad>", "<unk>")
    assert cfg["model_max_length"] >= 96


def test_loads_through_the_model_loader():
    """The same path `pj.load_model` takes for a HF folder: tokenizer.json + tokenizer_config.json."""
    tokenizer_mod = pytest.importorskip("parse_jax.models.tokenizer")
    tok = tokenizer_mod.Tokenizer.from_folder(TOKENIZER_DIR)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.vocab_size == TOK.get_vocab_size()
    task = load_task()
    for prompt, ref in task.problems(20, 0):
        text = f"{prompt} {ref}"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id, *ids, tok.eos_id, 0, 0]) == text  # specials dropped on decode
    assert len(tok.encode(" " + JUDGE_YES)) == len(tok.encode(" " + JUDGE_NO)) == 1
