"""The embedded pair's tokenizer: a real `tokenizer.json` built with the `tokenizers` library.

WordLevel over the task's symbols, a WhitespaceSplit pre-tokenizer, and a decoder that joins tokens with one space
(WordPiece with cleanup off; no symbol starts with its "##" prefix). Every task text is single-space separated, so
`decode(encode(text)) == text` exactly, and a leading space changes nothing: `" Correct"` and `"Correct"` are the
same single token. Special tokens: `<pad>` (id 0), `<bos>`, `<eos>`, `<unk>`; a post-processor that prepends `<bos>`,
so a prompt is encoded with it wherever transformers' `tokenizer(text)` encodes it (the models were trained so),
this library's prompts and an exported pair's alike; `Tokenizer.encode` adds nothing.

Regenerate the shipped files with `python -m parse_jax.tasks`.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from parse_jax.tasks.arith import Task, load_task

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
MODEL_MAX_LENGTH = 128
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"


def build_tokenizer(task: Task | None = None) -> tokenizers.Tokenizer:
    """The tokenizer of `task` (default: the default task; every config of the family gives the same one)."""
    task = task if task is not None else load_task()
    symbols = list(task.vocabulary())
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *symbols])}
    if len(vocab) != len(SPECIAL_TOKENS) + len(symbols):
        raise ValueError("duplicate symbols in the task vocabulary")
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    return tok


def tokenizer_config() -> dict[str, object]:
    """`tokenizer_config.json`: the special tokens by name (the loader resolves their ids through the vocab)."""
    return {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(folder: str | Path = TOKENIZER_DIR, task: Task | None = None) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` into `folder` (created if needed); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(build_tokenizer(task).to_str(pretty=True) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    return folder

