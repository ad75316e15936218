"""Tokenizer: exact round trips, no special tokens added, BOS/EOS resolution, chat templates as HF renders them."""

from __future__ import annotations

import json

import pytest
import transformers

from parse_jax.errors import CheckpointError, ConfigError, InputError
from parse_jax.models.tokenizer import Tokenizer
from tests.models.hf_tiny import BOS_ID, CHAT_TEMPLATE, EOS_ID, SPECIALS, TOKENIZER_VOCAB, write_tokenizer

TEXTS = ["hello world, 1 + 2 = 3; therefore x = 3.", "Step 1: 7 * 6 = 42\n\nStep 2:", "  ünïcode ✓ 数学 ", "x"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return folder


def test_round_trip_and_no_special_tokens(folder) -> None:
    tok = Tokenizer.from_folder(folder)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.vocab_size == TOKENIZER_VOCAB
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert BOS_ID not in ids and EOS_ID not in ids
        assert tok.decode(ids) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges are really used


@pytest.mark.parametrize("post", ["bos", "byte_level", "none"])
def test_prompts_are_encoded_as_transformers_tokenizer_call_encodes_them(tmp_path, post) -> None:
    """A text prompt gets the special tokens `tokenizer(text)` gives it: those `tokenizer.json`'s post-processor
    adds, BOS where it prepends one (Llama-3, the embedded pair), none where it adds none although `bos_token` is
    named (a GPT-2 style tokenizer under a llama config: BOS was prepended, so the model read another prompt than
    under transformers); tokenizer_config's add_bos_token changes nothing there, in transformers neither. A
    tokenizer.json without a post-processor (this library's before it had one, which transformers reads without
    BOS) keeps the named BOS its models were trained with. A prompt that starts with BOS keeps one."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import processors

    from parse_jax.models.model import Model
    from parse_jax.runtime.requests import encode_prompts
    from tests.random_models import random_model

    write_tokenizer(tmp_path)
    raw = RawTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = raw.id_to_token(BOS_ID)
    raw.post_processor = {"bos": processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS_ID)]),
                          "byte_level": processors.ByteLevel(trim_offsets=False), "none": None}[post]
    raw.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": post != "bos"}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.bos_id == BOS_ID  # named by tokenizer_config.json in every case
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    base = random_model("llama3", 0, vocab_size=TOKENIZER_VOCAB)
    model = Model(base.config, base.params, tok)
    for text in TEXTS:
        theirs = reference(text)["input_ids"]
        assert (theirs[:1] == [BOS_ID]) == (post == "bos")
        assert encode_prompts(model, [text]) == [[BOS_ID, *theirs] if post == "none" else theirs]
        assert encode_prompts(model, [text], add_bos=False) == [reference(text, add_special_tokens=False)["input_ids"]]
    assert encode_prompts(model, [bos + TEXTS[0]])[0].count(BOS_ID) == 1


def test_decode_skips_special_tokens(folder) -> None:
    tok = Tokenizer.from_folder(folder)
    ids = [BOS_ID, *tok.encode("hello"), tok.token_to_id("<|im_end|>"), *tok.encode(" world"), EOS_ID]
    assert tok.decode(ids) == "hello world"
    assert tok.encode("<|eos|>") == [EOS_ID]  # special tokens in text are still recognized as such


def test_bos_eos_from_tokenizer_config(folder) -> None:
    tok = Tokenizer.from_folder(folder)
    assert (tok.bos_id, tok.eos_id) == (BOS_ID, EOS_ID)  # bos given as a string, eos as an AddedToken dict
    assert (tok.bos_token, tok.eos_token) == SPECIALS[:2]


def test_bos_eos_never_fall_back_to_config_json(tmp_path) -> None:
    """As transformers: tokenizer files decide (stop ids from config.json go into ModelConfig.eos_token_ids)."""
    write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("bos_token")
    cfg["eos_token"] = None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert (Tokenizer.from_folder(tmp_path).bos_id, Tokenizer.from_folder(tmp_path).eos_id) == (None, None)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 3, "eos_token_id": [2, 1]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (None, None)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (reference.bos_token_id, reference.eos_token_id) == (None, None)
    # an explicit fallback applies where the files do not mention the token (bos), not over an explicit null (eos)
    assert (Tokenizer.from_folder(tmp_path, bos_id=1, eos_id=0).bos_id,
            Tokenizer.from_folder(tmp_path, bos_id=1, eos_id=0).eos_id) == (1, None)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(folder, add_generation_prompt: bool) -> None:
    tok = Tokenizer.from_folder(folder)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_from_jinja_file_and_save(folder, tmp_path) -> None:
    """transformers 5 writes chat_template.jinja; save() must carry it along."""
    src = tmp_path / "src"
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(src)
    assert (src / "chat_template.jinja").is_file()
    tok = Tokenizer.from_folder(src)
    assert tok.chat_template == CHAT_TEMPLATE
    tok.save(tmp_path / "copy")
    copy = Tokenizer.from_folder(tmp_path / "copy")
    assert (copy.bos_id, copy.eos_id, copy.vocab_size) == (BOS_ID, EOS_ID, TOKENIZER_VOCAB)
    assert copy.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(
        p.name for p in src.iterdir() if p.name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))


def test_chat_template_errors(folder, tmp_path) -> None:
    tok = Tokenizer.from_folder(folder)
    with pytest.raises(InputError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no chat_template"):
        Tokenizer.from_folder(tmp_path).apply_chat_template(MESSAGES)


def test_sandbox_blocks_attribute_escapes(folder) -> None:
    tok = Tokenizer.from_folder(folder)
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InputError):
        tok.apply_chat_template(MESSAGES)
    tok.chat_template = "{% for m in messages %}"
    with pytest.raises(ConfigError, match="not valid jinja"):
        tok.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json_names_path(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("kind", ["unigram", "wordlevel", "bytelevel"])
def test_unknown_token_is_found_for_every_model_type(kind: str) -> None:
    import tokenizers
    from tokenizers import models, pre_tokenizers

    if kind == "unigram":
        tok = tokenizers.Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -1.0)], 0, False))
    elif kind == "wordlevel":
        tok = tokenizers.Tokenizer(models.WordLevel({"a": 0, "<unk>": 1, "b": 2}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    else:
        from tests.models.hf_tiny import make_tokenizer
        tok = make_tokenizer()
    ours = Tokenizer({"tokenizer.json": tok.to_str().encode()})
    assert ours.unk_id == {"unigram": 0, "wordlevel": 1, "bytelevel": None}[kind]
    assert ours.has_unknown(ours.encode("a z b")) == (kind != "bytelevel")
    assert not ours.has_unknown(ours.encode("a b" if kind == "wordlevel" else "ab"))
