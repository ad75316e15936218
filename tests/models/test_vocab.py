"""align_vocab: one tokenizer, embeddings padded to different row counts (Qwen2.5-7B 152064 vs 0.5B 151936):
the smaller model is padded, every padding row is masked in the decoder, real rows are untouched."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import parse_jax as pj
from parse_jax.checkpoints.load import load_model
from parse_jax.checkpoints.orbax import save_model
from parse_jax.errors import ConfigError
from parse_jax.models.config import MASKED_LOGIT
from parse_jax.models.model import Model
from parse_jax.models.vocab import align_vocab
from tests.models.hf_tiny import VOCAB, make_tiny_hf

BIG = VOCAB + 32
IDS = np.random.default_rng(0).integers(0, 300, size=(2, 12))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vocab")
    return {"target": make_tiny_hf("qwen3", root / "target", seed=0, vocab=BIG),
            "draft": make_tiny_hf("qwen2", root / "draft", seed=1),  # tied embeddings: the embed.attend path
            "other": make_tiny_hf("qwen2", root / "other", seed=2, tokenizer="qwen")}


def _greedy_bait(model: Model) -> Model:
    """The target with its padding rows (>= VOCAB) made the argmax: copies of real rows, scaled up."""
    params = dict(model.params)
    kernel = np.array(params["lm_head"]["kernel"])
    kernel[:, VOCAB:] = 10 * kernel[:, : BIG - VOCAB]
    params["lm_head"] = {"kernel": kernel}
    return Model(model.config, params, model.tokenizer)


def test_sizes_equal_and_real_rows_unchanged(folders) -> None:
    target, draft = load_model(folders["target"]), load_model(folders["draft"])
    t2, d2 = align_vocab(target, draft)
    assert t2.config.vocab_size == d2.config.vocab_size == BIG
    assert t2.config.vocab_limit == d2.config.vocab_limit == VOCAB
    assert (target.config.vocab_size, draft.config.vocab_size) == (BIG, VOCAB)  # the inputs are not changed
    for before, after in ((target, t2), (draft, d2)):
        old, new = before.logits(IDS), after.logits(IDS)
        np.testing.assert_allclose(new[..., :VOCAB], old[..., :VOCAB], atol=1e-5, rtol=2e-6)  # fusion order
        assert (new[..., VOCAB:] == MASKED_LOGIT).all()
    assert t2.tokenizer is target.tokenizer and d2.tokenizer is draft.tokenizer


def test_padded_rows_are_never_argmax_nor_sampled(folders) -> None:
    target = _greedy_bait(load_model(folders["target"]))
    aligned, _ = align_vocab(target, load_model(folders["draft"]))
    prompts = [IDS[0].tolist(), IDS[1].tolist()]
    unmasked = pj.generate(target, prompts, max_new_tokens=16, eos_ids=[]).tokens
    assert max(max(row) for row in unmasked) >= VOCAB  # the bait works: without the mask the test fails
    for temperature in (0.0, 5.0):
        rows = pj.generate(aligned, prompts, max_new_tokens=16, eos_ids=[], temperature=temperature).tokens
        assert max(max(row) for row in rows) < VOCAB and all(len(row) == 16 for row in rows)


def test_greedy_output_of_real_rows_is_unchanged(folders) -> None:
    target, draft = load_model(folders["target"]), load_model(folders["draft"])
    t2, d2 = align_vocab(target, draft)
    prompts = [IDS[0].tolist()]
    for before, after in ((target, t2), (draft, d2)):
        want = pj.generate(before, prompts, max_new_tokens=12, eos_ids=[]).tokens
        if max(want[0]) < VOCAB:
            assert pj.generate(after, prompts, max_new_tokens=12, eos_ids=[]).tokens == want


def test_mismatched_tokenizer_is_refused_naming_both_sizes(folders) -> None:
    target, other = load_model(folders["target"]), load_model(folders["other"])
    with pytest.raises(ConfigError, match=rf"tokenizers differ \(target: 300 tokens, {BIG} embedding rows.*"
                                          rf"draft: \d+ tokens, 384 embedding rows"):
        align_vocab(target, other)
    with pytest.raises(ConfigError, match=rf"target {BIG} rows, draft {VOCAB} rows.*no tokenizer"):
        align_vocab(target, Model(load_model(folders["draft"]).config, load_model(folders["draft"]).params))


def test_same_tokenizer_written_differently_is_accepted(folders, tmp_path) -> None:
    """Tokenizers compare by content (vocab, merges, pre-tokenizer), not by bytes."""
    draft = tmp_path / "draft"
    shutil.copytree(folders["draft"], draft)
    d = json.loads((draft / "tokenizer.json").read_text())
    d["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in d["model"]["merges"]]
    d["truncation"] = None
    (draft / "tokenizer.json").write_text(json.dumps(d))
    t2, d2 = align_vocab(load_model(folders["target"]), load_model(draft))
    assert t2.config.vocab_size == d2.config.vocab_size == BIG


def test_equal_sizes_are_returned_as_they_are(folders) -> None:
    draft = load_model(folders["draft"])
    assert align_vocab(draft, draft) == (draft, draft)


def test_padded_model_round_trips(folders, tmp_path) -> None:
    _, d2 = align_vocab(load_model(folders["target"]), load_model(folders["draft"]))
    back = load_model(save_model(d2, tmp_path / "ckpt"))
    assert back.config == d2.config and back.config.vocab_limit == VOCAB
    np.testing.assert_array_equal(back.logits(IDS), d2.logits(IDS))


def test_a_target_with_fewer_rows_than_its_draft_keeps_its_eagle3_head(folders) -> None:
    """The draft pads the target (Qwen2.5-0.5B drafting for a target saved with fewer rows): the head, checked
    against the target it was trained for, runs beside the padded one, and greedy eagle3 and parse+eagle3 are still
    the target alone."""
    from tests.speculation.test_eagle3 import random_head

    target, draft = load_model(folders["draft"]), load_model(folders["target"])  # VOCAB rows, BIG rows
    head = random_head(target, seed=3)
    engine = pj.ParseEngine(target, draft, pj.ParseConfig(schedule="fixed"), eagle3=head)
    assert engine.target.config.vocab_size == BIG and engine.eagle3 is not None
    prompts = [IDS[0].tolist()]
    want = pj.generate(target, prompts, max_new_tokens=12, eos_ids=[]).tokens
    for mode in ("eagle3", "parse+eagle3"):
        assert engine.generate(prompts, mode=mode, max_new_tokens=12, eos_ids=[]).tokens == want, mode
