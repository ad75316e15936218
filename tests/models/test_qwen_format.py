"""A tiny random Qwen3 in Qwen's real folder format (byte-level BPE with Qwen's split regex, `bos_token: null`,
`<|im_end|>` as EOS, a second stop id `<|endoftext|>` only in generation_config.json): BOS, stop ids, chat template
and special ids exactly as transformers has them, and generation_config.json kept by save / convert / export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import parse_jax as pj
from parse_jax.checkpoints.hf import export_hf
from parse_jax.checkpoints.load import convert_hf, load_model
from parse_jax.checkpoints.orbax import save_model
from parse_jax.errors import ConfigError
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.runtime.requests import encode_prompts
from parse_jax.tasks.tokenizer import TOKENIZER_DIR
from tests.models.hf_tiny import QWEN_ADDED, QWEN_SPECIALS, hf_model, make_tiny_hf, write_tokenizer

PROMPT = "so we add 3 * 4 = 12.\n\nthe total is"
BUDGET = 24


def _hf_tokens(model: torch.nn.Module, ids: list[int], **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=BUDGET, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict:
    """The folder, its special ids, and where transformers' greedy output stops.

    The random model is permuted (embedding and lm_head rows of a token it emits mid-answer swapped with
    `<|endoftext|>`'s): an exact relabelling, so greedy decoding emits `<|endoftext|>` there, and transformers stops
    on it only because generation_config.json lists it."""
    folder = make_tiny_hf("qwen3", tmp_path_factory.mktemp("qwen3-format"), seed=3, tokenizer="qwen")
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = {t: hf_tok.convert_tokens_to_ids(t) for t in (*QWEN_SPECIALS, *QWEN_ADDED)}
    end, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    prompt = hf_tok(PROMPT).input_ids
    model = hf_model(folder)
    free = _hf_tokens(model, prompt, eos_token_id=None)
    stop_at = next(i for i in range(3, BUDGET) if free[i] not in prompt + free[:i] and free[i] not in ids.values())
    token = free[stop_at]
    assert end not in free
    with torch.no_grad():
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight[[token, end]] = weight[[end, token]].clone()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": end, "eos_token_id": [im_end, end], "do_sample": False}, indent=2))
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == im_end and config["bos_token_id"] == end  # the second stop id is not here
    return {"folder": folder, "ids": ids, "prompt": prompt, "stop_at": stop_at}


def test_no_bos_when_the_tokenizer_has_none(qwen) -> None:
    """config.json says bos_token_id <|endoftext|>, tokenizer_config.json `bos_token: null`: HF adds nothing."""
    model = load_model(qwen["folder"])
    hf_tok = transformers.AutoTokenizer.from_pretrained(qwen["folder"])
    assert hf_tok.bos_token_id is None and model.tokenizer.bos_id is None
    assert model.config.bos_token_id == qwen["ids"]["<|endoftext|>"]  # config.json's id is kept, never prepended
    assert encode_prompts(model, [PROMPT]) == [hf_tok(PROMPT).input_ids] == [qwen["prompt"]]
    text = pj.generate(model, [PROMPT], max_new_tokens=6, eos_ids=[]).tokens
    assert text == pj.generate(model, [qwen["prompt"]], max_new_tokens=6, eos_ids=[]).tokens


@pytest.mark.parametrize("how", ["absent", "null"])
def test_bos_follows_transformers_not_config_json(tmp_path, how: str) -> None:
    write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if how == "absent":
        cfg.pop("bos_token")
    else:
        cfg["bos_token"] = None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "bos_token_id": 3, "eos_token_id": 2}))
    ours, theirs = Tokenizer.from_folder(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.bos_id is None and theirs.bos_token_id is None
    assert ours.eos_id == theirs.eos_token_id == 1
    assert ours.encode("hello world") == theirs("hello world").input_ids
    # explicit fallbacks apply only when the files do not mention the token at all
    assert Tokenizer.from_folder(tmp_path, bos_id=3).bos_id == (3 if how == "absent" else None)


def test_stop_ids_merge_config_generation_config_and_tokenizer(qwen) -> None:
    cfg = load_model(qwen["folder"]).config
    assert cfg.eos_token_ids == (qwen["ids"]["<|im_end|>"], qwen["ids"]["<|endoftext|>"])


def test_generate_stops_at_an_eos_only_in_generation_config(qwen) -> None:
    theirs = _hf_tokens(hf_model(qwen["folder"]), qwen["prompt"])
    assert theirs[-1] == qwen["ids"]["<|endoftext|>"] and len(theirs) == qwen["stop_at"] + 1 < BUDGET
    model = load_model(qwen["folder"])
    assert pj.generate(model, [PROMPT], max_new_tokens=BUDGET).tokens == [theirs]
    # without generation_config.json's id the same run goes past it: the test can fail
    longer = pj.generate(model, [PROMPT], max_new_tokens=BUDGET, eos_ids=[qwen["ids"]["<|im_end|>"]]).tokens[0]
    assert len(longer) > len(theirs) and longer[:len(theirs)] == theirs


def test_generation_config_is_kept_by_save_convert_and_export(qwen, tmp_path) -> None:
    original = (qwen["folder"] / "generation_config.json").read_bytes()
    model = load_model(qwen["folder"])
    saved = save_model(model, tmp_path / "ckpt")
    converted = convert_hf(qwen["folder"], tmp_path / "conv")
    exported = export_hf(load_model(saved), tmp_path / "hf")
    for folder in (saved, converted, exported):
        assert (folder / "generation_config.json").read_bytes() == original
        assert load_model(folder).config.eos_token_ids == model.config.eos_token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert list(hf.generation_config.eos_token_id) == [qwen["ids"]["<|im_end|>"], qwen["ids"]["<|endoftext|>"]]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_passes_template_kwargs(qwen, kwargs) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    ours = Tokenizer.from_folder(qwen["folder"]).apply_chat_template(messages, **kwargs)
    theirs = transformers.AutoTokenizer.from_pretrained(qwen["folder"]).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours == theirs
    assert ours.endswith("<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)


def test_special_ids_and_unknown_tokens(qwen) -> None:
    tok = Tokenizer.from_folder(qwen["folder"])
    assert tok.special_ids == frozenset(qwen["ids"].values())
    assert tok.unk_id is None and not tok.has_unknown(tok.encode("any text at all ✓"))  # byte-level: nothing unknown
    assert tok.encode("<|im_end|>")[0] in tok.special_ids and tok.encode(" Correct")[0] not in tok.special_ids
    task = Tokenizer.from_folder(TOKENIZER_DIR)  # a word-level vocabulary with <unk>
    assert task.unk_id == task.token_to_id("<unk>") and task.unk_id in task.special_ids
    assert task.has_unknown(task.encode("Yes")) and not task.has_unknown(task.encode("Correct"))


def test_stop_ids_outside_the_vocabulary_are_refused(qwen, tmp_path) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(qwen["folder"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 100000]}))
    with pytest.raises(ConfigError, match=r"generation_config.json field 'eos_token_id' is 100000.*allowed 0\.\.383"):
        load_model(folder)


def test_chat_prompt_round_trip_ids(qwen) -> None:
    """A rendered chat prompt encodes to the same ids as transformers' tokenized template (specials included)."""
    model = load_model(qwen["folder"])
    hf_tok = transformers.AutoTokenizer.from_pretrained(qwen["folder"])
    messages = [{"role": "user", "content": PROMPT}]
    text = model.tokenizer.apply_chat_template(messages, enable_thinking=False)
    theirs = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, enable_thinking=False)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert encode_prompts(model, [text]) == [list(np.asarray(theirs).reshape(-1))]


def test_qwen_split_glues_newlines_to_punctuation(qwen) -> None:
    """The fixture really has Qwen's hard case for step boundaries (`.ĊĊ` one token)."""
    tok = Tokenizer.from_folder(Path(qwen["folder"]))
    assert any(tok.id_to_token(i) in (".ĊĊ", ":ĊĊ", ".ĊĊĊ", ":ĊĊĊ") for i in tok.encode(PROMPT + ":\n\n"))
