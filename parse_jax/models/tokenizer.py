"""`Tokenizer`: a HF `tokenizer.json` (via the `tokenizers` library) plus the bits of
`tokenizer_config.json` generation needs: BOS/EOS ids and the jinja chat template.

No `transformers` at run time: the fast tokenizer file holds the whole pipeline, and the chat template
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

# Every file `save` writes back when it was present at load; the first one is required.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")


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


def _first_id(value: Any) -> int | None:
    """config.json's `eos_token_id` may be an int or a list of ints; take the first."""
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else None


class Tokenizer:
    """Text <-> ids without special tokens, plus BOS/EOS ids and chat-template rendering.

    Holds the raw bytes of the tokenizer files it was built from, so `save` reproduces them exactly
    even when the source folder is gone.
    """

    def __init__(self, files: Mapping[str, bytes], *, bos_id: int | None = None, eos_id: int | None = None,
                 source: str = "<memory>") -> None:
        """`files`: file name -> contents (must include tokenizer.json); `bos_id`/`eos_id` are the
        fallbacks used when tokenizer_config.json names no BOS/EOS token (HF falls back to config.json)."""
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
        self.bos_id = self._resolve(self.bos_token, bos_id)
        self.eos_id = self._resolve(self.eos_token, eos_id)
        if self.bos_token is None and self.bos_id is not None:
            self.bos_token = self._tok.id_to_token(self.bos_id)
        if self.eos_token is None and self.eos_id is not None:
            self.eos_token = self._tok.id_to_token(self.eos_id)
        self.chat_template = self._find_chat_template(config)

    @classmethod
    def from_folder(cls, folder: str | Path, bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
        """Load the tokenizer files of a HF model folder (or a parse-jax checkpoint).

        BOS/EOS fall back to `bos_id`/`eos_id`, else to the folder's config.json ids."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"tokenizer.json not found: {path}")
        files = {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}
        if (bos_id is None or eos_id is None) and (folder / "config.json").is_file():
            cfg = _read_json("config.json", (folder / "config.json").read_bytes(), str(folder))
            bos_id = bos_id if bos_id is not None else _first_id(cfg.get("bos_token_id"))
            eos_id = eos_id if eos_id is not None else _first_id(cfg.get("eos_token_id"))
        return cls(files, bos_id=bos_id, eos_id=eos_id, source=str(folder))

    def _resolve(self, token: str | None, fallback: int | None) -> int | None:
        """A named token wins; one missing from the vocabulary is treated as not named."""
        token_id = self._tok.token_to_id(token) if token is not None else None
        return token_id if token_id is not None else fallback

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

    def decode(self, ids: Any) -> str:
        """Text of `ids`, special tokens (BOS, EOS, chat markers) dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the model's chat template, as `transformers` would (tokenize=False)."""
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
