"""Tiny random Hugging Face models on disk, for parity and import tests (not a test module).

Every parameter is randomized (norm scales around 1, non-zero biases) so that a mistake in any
tensor's mapping, bias or norm shows in the logits. Models are written with `save_pretrained`
(safetensors), next to a real byte-level BPE `tokenizer.json` and a small jinja chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

FAMILIES = ("llama3", "qwen2", "qwen3")
VOCAB = 320  # model embedding rows; the tokenizer has TOKENIZER_VOCAB <= VOCAB ids, like real Qwen models
TOKENIZER_VOCAB = 300
SPECIALS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 0, 1  # special tokens are added first, in SPECIALS order
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, 1 + 2 = 3; therefore x = 3.",
    "Is every step so far correct? Answer: Correct",
    "Step 1: 7 * 6 = 42\n\nStep 2: 42 - 2 = 40\n\nThe answer is 40.",
]


# Qwen's tokenizer format: byte-level BPE behind Qwen2's split regex (which glues "\n\n" to the punctuation before
# it: `.ĊĊ` is one token), NFC, specials appended after the BPE vocabulary, `<think>` tags as plain added tokens.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<think>", "</think>")
QWEN_VOCAB = 384  # model rows of the Qwen-style folders
QWEN_TOKENIZER_VOCAB = 370  # BPE ids + the 5 added tokens
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def step_corpus(n: int = 300, seed: int = 0) -> list[str]:
    """Generated solutions whose steps end in "\n\n" (or "\n\n\n") after `.`, `:`, a digit or a word."""
    rng = random.Random(seed)
    words = ["the", "answer", "is", "so", "we", "add", "take", "total", "apples", "each", "box", "left", "Step",
             "then", "first", "next", "now", "therefore", "hello", "world"]
    texts = []
    for _ in range(n):
        steps = []
        for _ in range(rng.randint(2, 5)):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            body = " ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
            end = rng.choice([".", ":", f" {a + b}", f" {rng.choice(words)}", f" {a} * {b} = {a * b}."])
            steps.append(body + end + rng.choice(["\n\n", "\n\n", "\n\n\n"]))
        texts.append("".join(steps) + "The answer is 42.")
    return texts


def make_qwen_tokenizer(vocab: int = QWEN_TOKENIZER_VOCAB) -> Tokenizer:
    """A tokenizer in Qwen2/Qwen3's format, trained on `step_corpus()`."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(QWEN_SPECIALS) - len(QWEN_ADDED),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(step_corpus(), trainer)
    tok.add_special_tokens(list(QWEN_SPECIALS))
    tok.add_tokens(list(QWEN_ADDED))
    return tok


def write_qwen_tokenizer(folder: str | Path) -> dict[str, int]:
    """tokenizer.json + Qwen's tokenizer_config.json (`bos_token: null`, eos `<|im_end|>`, pad `<|endoftext|>`,
    a chat template with `enable_thinking`); returns the special tokens' ids."""
    folder = Path(folder)
    tok = make_qwen_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "model_max_length": 4096,
              "chat_template": QWEN_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {t: tok.token_to_id(t) for t in (*QWEN_SPECIALS, *QWEN_ADDED)}


def _config(family: str, vocab: int = VOCAB, bos: int | None = BOS_ID, eos: int | list[int] | None = EOS_ID,
            rope: dict | None = None) -> transformers.PretrainedConfig:
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  bos_token_id=bos, eos_token_id=eos, rms_norm_eps=1e-5)
    if rope is not None:  # e.g. yarn: {"rope_type": "yarn", "rope_theta": ..., "factor": ...}
        common["rope_parameters"] = rope
        if family == "llama3":
            return transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256, tie_word_embeddings=False)
    if family == "llama3":
        # original_max_position_embeddings 32 < test length 40, and with head_dim 16 the wavelengths span
        # both sides of 32/low and 32/high: all three branches of llama3 scaling are exercised.
        return transformers.LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32})
    if family == "qwen2":
        return transformers.Qwen2Config(**common, num_attention_heads=8, num_key_value_heads=2,
                                        max_position_embeddings=512, tie_word_embeddings=True, rope_theta=1e6)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=512, tie_word_embeddings=False, rope_theta=1e6)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.5 * noise
            elif name.endswith("embed_tokens.weight"):
                value = noise
            else:
                value = noise / p.shape[-1] ** 0.5
            p.copy_(value.to(p.dtype))


def make_tokenizer() -> Tokenizer:
    """A byte-level BPE (any text round-trips) with bos/eos and chat-marker special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


def write_tokenizer(folder: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """tokenizer.json + tokenizer_config.json (bos as a string, eos as an AddedToken dict, as HF writes them)."""
    folder = Path(folder)
    (tokenizer or make_tokenizer()).save(str(folder / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": SPECIALS[1], "lstrip": False, "rstrip": False,
           "normalized": False, "single_word": False, "special": True}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": eos,
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_tiny_hf(family: str, folder: str | Path, seed: int = 0, dtype: str = "float32",
                 sharded: bool = False, tokenizer: str = "basic", vocab: int | None = None,
                 rope: dict | None = None) -> Path:
    """Write a tiny random `family` model (llama3, qwen2, qwen3) as a HF folder; returns the folder.

    `tokenizer="qwen"`: the Qwen-format tokenizer (`write_qwen_tokenizer`), config.json with Qwen's ids
    (bos_token_id <|endoftext|> although the tokenizer has no BOS, eos_token_id <|im_end|>), QWEN_VOCAB rows.
    `vocab`: embedding rows; `rope`: transformers' `rope_parameters` (e.g. yarn)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "qwen":
        ids = write_qwen_tokenizer(folder)
        config = _config(family, vocab or QWEN_VOCAB, ids["<|endoftext|>"], ids["<|im_end|>"], rope)
    else:
        config = _config(family, vocab or VOCAB, rope=rope)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    if sharded:
        model.save_pretrained(folder, max_shard_size="40KB")
    else:
        model.save_pretrained(folder)
    if tokenizer != "qwen":
        write_tokenizer(folder)
    return folder


def hf_model(folder: str | Path) -> torch.nn.Module:
    """The PyTorch model of a HF folder, in float32, for reference logits."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(folder_or_model: str | Path | torch.nn.Module, ids) -> np.ndarray:
    """float32 [B, T, V] logits of the PyTorch model on int ids [B, T]."""
    model = folder_or_model if isinstance(folder_or_model, torch.nn.Module) else hf_model(folder_or_model)
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
