"""PARSE on chat models in real formats (a tiny random Qwen3 with a byte-level BPE tokenizer in Qwen's format, built
here): step boundaries from the decoded text, the verification suffix rendered through the chat template, judge words
of several tokens, special tokens refused."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import parse_jax as pj
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError
from parse_jax.verify.host_segment import delimiter_boundaries
from tests.models.hf_tiny import hf_logits, make_tiny_hf, step_corpus

QUESTION = "Is every step so far correct?"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = make_tiny_hf("qwen3", tmp_path_factory.mktemp("qwen3"), seed=3, tokenizer="qwen")
    return folder, pj.load_model(folder)


def test_boundaries_are_the_texts_step_ends(qwen):
    """Every step of the generated solutions ends in "\\n\\n" (or "\\n\\n\\n") after `.`, `:`, a digit or a word; BPE
    merges the newlines with what precedes them, so matching the delimiter's token ids misses step ends that the
    decoded text shows."""
    _, m = qwen
    tok = m.tokenizer
    eng = ParseEngine(m, m, ParseConfig(delimiter="\n\n", max_prefixes=64))
    found = missed_by_ids = total = 0
    for text in step_corpus(40, seed=7):
        ids = tok.encode(text)
        offsets = tok._tok.encode(text, add_special_tokens=False).offsets
        ends = [m_.end() for m_ in re.finditer("\n\n", text)]  # leftmost, non-overlapping, as the segmenter
        expect = sorted({next(t for t, (a, b) in enumerate(offsets) if a < e <= b) + 1 for e in ends})
        got = eng.boundaries(ids)
        assert got[:-1] == [b for b in expect if b < len(ids)] and got[-1] == len(ids), text
        for b in got[:-1]:  # each prefix ends with its step's newlines
            assert "\n\n" in tok.decode(ids[b - 1: b]) or tok.decode(ids[:b]).endswith("\n\n")
        total += len(ends)
        found += len(got) - 1
        missed_by_ids += len(ends) - (len(delimiter_boundaries(ids, tok.encode("\n\n"))) - 1)
    assert found == total and missed_by_ids > total // 4  # token ids miss many of them; the text finds all


def test_chat_suffix_scores_equal_transformers_separate_passes(qwen):
    folder, m = qwen
    cfg = ParseConfig(suffix_format="chat", verify_suffix=QUESTION, judge_yes=" correct", judge_no=" wrong",
                      delimiter=("\n\n", ".\n"))
    eng = ParseEngine(m, m, cfg)
    tok = m.tokenizer
    yes, no = tok.encode(" correct"), tok.encode(" wrong")
    assert len(yes) > 1 and yes[0] == no[0]  # several tokens each, sharing the leading space
    expect = ("<|im_end|>\n<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
              "<think>\n\n</think>\n\n ")  # thinking off; then the judge words' shared leading space
    assert tok._tok.decode(eng.suffix_ids, skip_special_tokens=False) == expect
    assert eng.suffix_ids[-1] == yes[0] and (eng.yes_id, eng.no_id) == (yes[1], no[1])
    ctx = tok.encode(tok.apply_chat_template([{"role": "user", "content": "add 3 and 4"}], enable_thinking=False))
    draft = tok.encode("we add 3 * 4 = 12.\n\nthe total is 12:\n\nThe answer is 12.")
    bounds = eng.boundaries(draft)
    assert len(bounds) == 3
    scores = eng.prefix_scores(ctx, draft, bounds)
    for k, b in enumerate(bounds):
        logits = hf_logits(folder, [ctx + draft[:b] + eng.suffix_ids])[0, -1]
        expect = 1 / (1 + np.exp(-(logits[eng.yes_id] - logits[eng.no_id])))
        assert abs(scores[k] - expect) <= 1e-5
    res = eng.generate([ctx], mode="parse", max_new_tokens=24)  # the fused program over the BPE automaton
    alone = eng.generate([ctx], mode="target", max_new_tokens=24)
    assert res.stats["host_transfers"] == 1 and len(res.tokens[0]) > 0 and len(alone.tokens[0]) > 0


def test_a_plain_chatml_suffix_with_special_tokens_scores_as_the_chat_template_suffix(qwen):
    """A hand-written ChatML turn as a plain verify_suffix: its special tokens encode as the model's special ids
    (as transformers encodes them), so the prefix scores are those of the chat-template suffix it spells out."""
    _, m = qwen
    tok = m.tokenizer
    words = {"judge_yes": " correct", "judge_no": " wrong", "delimiter": "\n\n"}
    chat = ParseEngine(m, m, ParseConfig(suffix_format="chat", verify_suffix=QUESTION, **words))
    spelled = ("<|im_end|>\n<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
               "<think>\n\n</think>\n\n")
    plain = ParseEngine(m, m, ParseConfig(verify_suffix=spelled, **words))
    special = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")}
    assert special <= set(plain.suffix_ids) and special <= tok.special_ids  # one special id each, not their letters
    assert plain.suffix_ids == chat.suffix_ids
    ctx = tok.encode(tok.apply_chat_template([{"role": "user", "content": "add 3 and 4"}], enable_thinking=False))
    draft = tok.encode("we add 3 * 4 = 12.\n\nthe total is 12:\n\nThe answer is 12.")
    bounds = chat.boundaries(draft)
    assert len(bounds) == 3
    np.testing.assert_array_equal(plain.prefix_scores(ctx, draft, bounds), chat.prefix_scores(ctx, draft, bounds))
    with pytest.raises(ConfigError, match="special token"):  # judge words stay ordinary text
        ParseEngine(m, m, ParseConfig(verify_suffix=spelled, judge_yes="<|im_end|>", judge_no=" wrong"))


def test_judge_words_that_cannot_be_scored_are_refused(qwen):
    _, m = qwen
    with pytest.raises(ConfigError, match="special token"):
        ParseEngine(m, m, ParseConfig(judge_yes="<|im_end|>", judge_no=" wrong"))
    with pytest.raises(ConfigError, match="prefix of the other"):
        ParseEngine(m, m, ParseConfig(judge_yes=" correct", judge_no=" correct."))


def test_a_chat_model_with_the_embedded_tasks_settings_is_warned_about(qwen, parse_jax_warnings):
    """Once, by the first request of a mode that judges; modes that never read the PARSE settings say nothing."""
    _, m = qwen
    eng = ParseEngine(m, m, ParseConfig())
    for mode in ("target", "sd"):
        eng.request(["Hi"], mode, 4, 0.0, 0, 0, 1.0, None)
    assert parse_jax_warnings == []
    for mode in ("parse", "sequential", "parse"):
        eng.request(["Hi"], mode, 4, 0.0, 0, 0, 1.0, None)
    assert len(parse_jax_warnings) == 1 and "PARSE settings are the embedded task's defaults" in parse_jax_warnings[0]
    ParseEngine(m, m, ParseConfig(judge_yes=" correct", judge_no=" wrong")).request(
        ["Hi"], "parse", 4, 0.0, 0, 0, 1.0, None)
    assert len(parse_jax_warnings) == 1
    eng = ParseEngine(m, m, ParseConfig())
    with pytest.raises(pj.InputError):  # a request refused says nothing of the settings
        eng.request(["Hi"], "parse", 10**6, 0.0, 0, 0, 1.0, None)
    assert len(parse_jax_warnings) == 1
    ids = m.tokenizer.encode("Hi there")
    eng.prefix_scores(ids, ids, [1, 2])  # scores with the judge: said
    assert len(parse_jax_warnings) == 2


def test_the_shipped_qwen3_config_runs_on_a_qwen_format_pair(qwen):
    """configs/parse/qwen3_chat.yaml: a chat-rendered suffix, judge words, blank-line steps in the decoded text."""
    _, m = qwen
    cfg = ParseConfig.load("qwen3_chat", schedule="fixed")  # PARSE itself, whatever the cost model says
    assert cfg.suffix_format == "chat" and cfg.delimiters == ("\n\n",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # settings made for the model: no warning about toy defaults
        eng = ParseEngine(m, m, cfg)
    ctx = m.tokenizer.encode(m.tokenizer.apply_chat_template([{"role": "user", "content": "add 3 and 4"}],
                                                              enable_thinking=False))
    res = eng.generate([ctx], mode="parse", max_new_tokens=16)
    assert res.stats["prefixes_per_request"][0] >= 1 and res.stats["host_transfers"] == 1


def test_parse_jax_eval_warns_about_a_chat_models_settings_once(qwen, parse_jax_warnings, tmp_path):
    """`parse-jax eval` checks its records and runs them with one engine: the chat-model warning is said once (two
    engines said it twice)."""
    from parse_jax.cli import main
    from parse_jax.harness.eval.data import write_task_jsonl
    from parse_jax.tasks import load_task

    folder, _ = qwen
    data = write_task_jsonl(load_task(), 2, tmp_path / "p.jsonl", seed=3)
    assert main(["eval", "--model", str(folder), "--draft", str(folder), "--mode", "parse", "--data", str(data),
                 "--max-new-tokens", "4", "--out", str(tmp_path / "r.jsonl"), "--no-progress", "-q"]) == 0
    said = [w for w in parse_jax_warnings if "PARSE settings are the embedded task's defaults" in w]
    assert len(said) == 1


def test_a_sweep_over_a_chat_model_warns_about_its_settings_once(qwen, tmp_path, capsys):
    """sweep builds one engine per value; the command says the chat-model warning once (it said it per value)."""
    from parse_jax.cli import main
    from parse_jax.harness.eval.data import write_task_jsonl
    from parse_jax.tasks import load_task

    folder, _ = qwen
    data = write_task_jsonl(load_task(), 2, tmp_path / "p.jsonl", seed=3)
    assert main(["sweep", "--model", str(folder), "--draft", str(folder), "--data", str(data), "--param", "threshold",
                 "--values", "0.0,1.0", "--max-new-tokens", "4", "--schedule", "fixed", "--repeats", "1",
                 "--out", str(tmp_path / "sweep"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("PARSE settings are the embedded task's defaults") == 1, err
