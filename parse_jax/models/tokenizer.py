"""`Tokenizer`: a HF `tokenizer.json` (via the `tokenizers` library) plus the bits of
`tokenizer_config.json` generation needs: BOS/EOS ids and the jinja chat template.

BOS and EOS are exactly what the tokenizer files define, as `transformers.AutoTokenizer` reads them: a
`bos_token: null` (Qwen) means no BOS even when config.json has a `bos_token_id` (stop ids from config.json and
generation_config.json go into `ModelConfig.eos_token_ids` instead).

No `transformers` at run time: the fast tokenizer file holds the pipeline (a prompt's BOS / EOS as transformers
adds them: `encode_prompt`), and the chat template
is rendered the way `transformers` renders it (sandboxed jinja2, `raise_exception`, `bos_token`, ...).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from parse_jax.errors import CheckpointError, ConfigError, InputError

# Every file `save` writes back when it was present at load; the first one is required. generation_config.json
# is not a tokenizer file, but it travels with them so that save / convert / export keep it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def _read_json(name: str, data: bytes | None, source: str) -> dict[str, Any]:
    if data is None:
        return {}
    try:
        d = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name} is not valid JSON ({source}): {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{name} must hold a JSON object ({source})")
    return d


def _token_content(value: Any) -> str | None:
    """HF writes special tokens either as a string or as an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Text <-> ids without special tokens, plus BOS/EOS ids and chat-template rendering.

    Holds the raw bytes of the tokenizer files it was built from, so `save` reproduces them exactly
    even when the source folder is gone.
    """

    def __init__(self, files: Mapping[str, bytes], *, bos_id: int | None = None, eos_id: int | None = None,
                 source: str = "<memory>") -> None:
        """`files`: file name -> contents (must include tokenizer.json); `bos_id`/`eos_id`: used only when
        neither tokenizer_config.json nor special_tokens_map.json has the key at all (a bare tokenizer.json built
        in memory); an explicit `null` there means none, as in transformers."""
        if "tokenizer.json" not in files:
            raise CheckpointError(f"tokenizer.json is required ({source})")
        self.source = source
        self.files = {name: bytes(data) for name, data in files.items() if name in TOKENIZER_FILES}
        try:
            self._tok = tokenizers.Tokenizer.from_str(self.files["tokenizer.json"].decode("utf-8"))
        except Exception as e:  # the Rust side raises its own exception type
            raise CheckpointError(f"cannot read tokenizer.json ({source}): {e}") from None
        config = _read_json("tokenizer_config.json", self.files.get("tokenizer_config.json"), source)
        special = _read_json("special_tokens_map.json", self.files.get("special_tokens_map.json"), source)
        self.bos_token = _token_content(config.get("bos_token")) or _token_content(special.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token")) or _token_content(special.get("eos_token"))
        self.unk_token = _token_content(config.get("unk_token")) or _token_content(special.get("unk_token"))
        named = lambda key: key in config or key in special  # noqa: E731
        self.bos_id = self._resolve(self.bos_token, None if named("bos_token") else bos_id)
        self.eos_id = self._resolve(self.eos_token, None if named("eos_token") else eos_id)
        if self.bos_token is None and self.bos_id is not None:
            self.bos_token = self._tok.id_to_token(self.bos_id)
        if self.eos_token is None and self.eos_id is not None:
            self.eos_token = self._tok.id_to_token(self.eos_id)
        self.unk_id = self._find_unk()
        self.chat_template = self._find_chat_template(config)
        # a prompt's special tokens (`encode_prompt`): the post-processor's; without one, BOS where one is named (this
        # library's tokenizers, saved before theirs had a post-processor, were trained so)
        self._has_post_processor = self._tok.post_processor is not None

    @classmethod
    def from_folder(cls, folder: str | Path, bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
        """Load the tokenizer files of a HF model folder (or a parse-jax checkpoint).

        BOS/EOS come from tokenizer_config.json / special_tokens_map.json only, as in transformers (config.json's
        ids are never a fallback: Qwen's `bos_token: null` beside a `bos_token_id` means no BOS); `bos_id` /
        `eos_id` apply only when those files do not mention the token at all."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"tokenizer.json not found: {path}")
        files = {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}
        return cls(files, bos_id=bos_id, eos_id=eos_id, source=str(folder))

    def _resolve(self, token: str | None, fallback: int | None) -> int | None:
        """A named token wins; one missing from the vocabulary is treated as not named."""
        token_id = self._tok.token_to_id(token) if token is not None else None
        return token_id if token_id is not None else fallback

    def _find_unk(self) -> int | None:
        """The id unknown text encodes to: the tokenizer model's `unk_token` (BPE, WordPiece, WordLevel) or
        `unk_id` (Unigram), else tokenizer_config.json's; None for byte-level BPE (nothing is unknown)."""
        if type(self._tok.model).__name__ == "Unigram":  # its unk_id is not exposed: read the file
            unk = (json.loads(self.files["tokenizer.json"].decode("utf-8")).get("model") or {}).get("unk_id")
            if isinstance(unk, int):
                return unk
        for token in (getattr(self._tok.model, "unk_token", None), self.unk_token):
            if isinstance(token, str) and self._tok.token_to_id(token) is not None:
                return self._tok.token_to_id(token)
        return None

    @functools.cached_property
    def token_texts(self) -> tuple[str, ...]:
        """The text of each token id on its own (special tokens: ""), for boundaries found in decoded text: a step
        delimiter such as "\n\n" is often merged with the character before it (`.\n\n` is one token)."""
        n = self._tok.get_vocab_size(with_added_tokens=True)
        return tuple(self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=True))

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of every added token (special or not: chat markers, `<think>`, BOS, EOS, padding) and of the
        unknown token: never valid as ordinary words (e.g. judge words)."""
        ids = set(self._tok.get_added_tokens_decoder())
        ids.update(x for x in (self.bos_id, self.eos_id, self.unk_id) if x is not None)
        return frozenset(ids)

    def has_unknown(self, ids: Any) -> bool:
        """Whether an encoding contains the unknown token (the text was not representable)."""
        return self.unk_id is not None and any(int(i) == self.unk_id for i in ids)

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Same id -> token map (added tokens included, with their special flags) and the same model, pre-tokenizer,
        normalizer and decoder: two files that encode every text to the same ids."""
        return self._identity == other._identity

    @functools.cached_property
    def _identity(self) -> tuple[Any, ...]:
        return _tokenizer_identity(self)

    def _find_chat_template(self, config: dict[str, Any]) -> str | None:
        """transformers 5 writes chat_template.jinja; older folders keep it in tokenizer_config.json
        (a string, or a list of named templates) or in chat_template.json."""
        if "chat_template.jinja" in self.files:
            return self.files["chat_template.jinja"].decode("utf-8")
        template = config.get("chat_template")
        if template is None and "chat_template.json" in self.files:
            template = _read_json("chat_template.json", self.files["chat_template.json"], self.source).get(
                "chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` exactly; no BOS/EOS or template tokens are added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt as transformers' `tokenizer(text)` gives them (`PreTrainedTokenizerFast`, Llama-3's and
        this library's class): with the special tokens `tokenizer.json`'s post-processor adds (Llama-3's and the
        embedded pair's BOS; none for Qwen3, nor for a GPT-2 style post-processor whatever `bos_token` names). A
        tokenizer.json without a post-processor gets the named BOS (this library's tokenizers before theirs had
        one, whose models were trained so; transformers adds none there). None where the text starts with the BOS
        token already (as lm-eval encodes such a context: a chat-rendered prompt's BOS is not doubled)."""
        encoding = self._tok.encode(text, add_special_tokens=False)  # tokenized once; special tokens added after
        ids = encoding.ids
        if self.bos_id is not None and ids[:1] == [self.bos_id]:
            return ids
        if self._has_post_processor:
            return self._tok.post_process(encoding).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: Any, keep_special: bool = False) -> str:
        """Text of `ids`, special tokens (BOS, EOS, chat markers) dropped unless `keep_special`."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=not keep_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the model's chat template, as `transformers` would (tokenize=False); extra
        keyword arguments reach the template (e.g. `enable_thinking=False` for Qwen3)."""
        if self.chat_template is None:
            raise ConfigError(f"the tokenizer has no chat_template (looked in tokenizer_config.json, "
                              f"chat_template.jinja and chat_template.json of {self.source})")
        try:
            template = _compile(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat_template of {self.source} is not valid jinja: {e}") from None
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **kwargs)
        except jinja2.TemplateError as e:
            raise InputError(f"chat template refused the messages: {e}") from None

    def save(self, folder: str | Path) -> None:
        """Write the tokenizer files this tokenizer was loaded from into `folder` (created if needed)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (folder / name).write_bytes(data)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, source={self.source!r})"


def _tokenizer_identity(tok: Tokenizer) -> tuple[Any, ...]:
    """What decides the ids of every text, normalized (merges as pairs, whichever format the file uses)."""
    d = json.loads(tok.files["tokenizer.json"].decode("utf-8"))
    model = dict(d.get("model") or {})
    if isinstance(model.get("merges"), list):
        model["merges"] = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    added = sorted((t.get("id"), t.get("content"), bool(t.get("special"))) for t in d.get("added_tokens") or [])
    parts = [json.dumps(x, sort_keys=True, default=list)
             for x in (model, d.get("normalizer"), d.get("pre_tokenizer"), d.get("decoder"))]
    return (*parts, added)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates must not do
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """Compile in the environment `transformers` renders chat templates in (templates are untrusted code)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
