"""One validation layer for every entry point (API and CLI alike): each check names the field, the value and what
is allowed, and raises the parse-jax error the caller chose (ConfigError for settings, InputError for requests).

Integers must be integers (a float such as 2.5 or 7.9, or a bool, is refused, never truncated); floats must be
finite numbers (NaN and inf refused) inside their range. Nothing here imports jax.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable

from parse_jax.errors import ConfigError, InputError, ParseJaxError

SEED_MAX = 2**31 - 1  # the one seed range (flags, generation, runs, training): what a generation key takes
SHOWN_CHARS = 200  # at most this much of a user's value is echoed in an error (a 20 MB record is cut)


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None,
              error: type[ParseJaxError] = ConfigError) -> int:
    """`value` as an int in [minimum, maximum]; floats with a fractional part, bools and strings are refused (a
    float with an integral value, e.g. 8.0 from YAML, is accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be an integer, got {value!r}")
    if not isinstance(value, numbers.Integral):
        if not math.isfinite(float(value)) or float(value) != int(value):
            raise error(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if minimum is not None and v < minimum:
        raise error(f"{name} must be >= {minimum}, got {v}" + (f" (allowed: {minimum}..{maximum})"
                                                              if maximum is not None else ""))
    if maximum is not None and v > maximum:
        raise error(f"{name} must be <= {maximum}, got {v}" + (f" (allowed: {minimum}..{maximum})"
                                                              if minimum is not None else ""))
    return v


def check_float(name: str, value, minimum: float | None = None, maximum: float | None = None,
                min_open: bool = False, max_open: bool = False,
                error: type[ParseJaxError] = ConfigError) -> float:
    """`value` as a finite float in the range (bounds closed unless `min_open` / `max_open`); strings, bools, NaN and
    inf are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise error(f"{name} must be a finite number, got {value!r}")
    lo = "(" if min_open or minimum is None else "["  # infinities are never in range (finite numbers only)
    hi = ")" if max_open or maximum is None else "]"
    allowed = f"{lo}{'-inf' if minimum is None else f'{minimum:g}'}, {'inf' if maximum is None else f'{maximum:g}'}{hi}"
    if minimum is not None and (v < minimum or (min_open and v == minimum)):
        raise error(f"{name} must lie in {allowed}, got {v:g}")
    if maximum is not None and (v > maximum or (max_open and v == maximum)):
        raise error(f"{name} must lie in {allowed}, got {v:g}")
    return v


def check_choice(name: str, value, choices: Iterable[str], error: type[ParseJaxError] = ConfigError) -> str:
    """`value` if it is one of `choices`."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise error(f"unknown {name} {value!r}; available: {', '.join(choices)}")
    return value


def check_draft(draft_len: int) -> None:
    """A draft to cut into prefixes has at least one token."""
    if draft_len < 1:
        raise InputError("the draft is empty: nothing to verify")


def check_boundaries(boundaries: Iterable[int], draft_len: int) -> list[int]:
    """Prefix ends of a draft (docs/design.md §2) as a validated list: strictly increasing, within (0, draft_len]."""
    check_draft(draft_len)
    if (isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Iterable)
            or getattr(boundaries, "ndim", 1) != 1):
        raise InputError(f"boundaries must be a list of token positions (ints), got {shorten(repr(boundaries))}")
    values = boundaries.tolist() if hasattr(boundaries, "tolist") else boundaries  # numpy or jax: Python numbers
    b = [check_int(f"boundary {i}", x, error=InputError) for i, x in enumerate(values)]
    if not b:
        raise InputError("no boundaries given: need at least one prefix to verify")
    if b[0] <= 0 or b[-1] > draft_len:
        raise InputError(f"boundaries must lie in (0, {draft_len}] for a draft of {draft_len} tokens, got {b}")
    if any(x >= y for x, y in zip(b, b[1:])):
        raise InputError(f"boundaries must be strictly increasing, got {b}")
    return b


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut to `limit` characters for an error message, saying how long it was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_seed(name: str, value, error: type[ParseJaxError] = ConfigError) -> int:
    """A seed in the one range every entry point takes: 0..SEED_MAX (2**31 - 1)."""
    return check_int(name, value, 0, SEED_MAX, error=error)


def check_eos_ids(eos_ids, vocab_size: int | None = None, name: str = "eos_ids",
                  error: type[ParseJaxError] = InputError) -> list[int] | None:
    """Stop ids as a list of ints inside [0, vocab_size) (None: the model's own; [] = none); a string is refused
    (never read as its characters)."""
    if eos_ids is None:
        return None
    if isinstance(eos_ids, (str, bytes)) or not isinstance(eos_ids, Iterable) or isinstance(eos_ids, dict):
        raise error(f"{name} must be a list of token ids, got {shorten(repr(eos_ids))}")
    top = None if vocab_size is None else vocab_size - 1
    return [check_int(name, t, 0, top, error=error) for t in eos_ids]


def check_text(name: str, value, error: type[ParseJaxError] = InputError) -> str:
    """A text input (a prompt): a string, not empty or only whitespace, and valid Unicode (a command-line byte that
    is not UTF-8 arrives as a lone surrogate, which no tokenizer takes)."""
    if not isinstance(value, str):
        raise error(f"{name} must be text, got {type(value).__name__}")
    if not value.strip():
        raise error(f"{name} is empty or only whitespace: nothing to generate from")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        shown = value.encode("utf-8", "surrogateescape" if _escaped_bytes(value) else "replace")
        raise error(f"{name} is not valid UTF-8 text (a byte that is not UTF-8 at character {e.start}: "
                    f"{shorten(shown.decode('utf-8', 'replace'), 60)!r})") from None
    return value


def _escaped_bytes(value: str) -> bool:
    """Whether every lone surrogate in `value` is an escaped byte (U+DC80..U+DCFF: a command-line byte that is not
    UTF-8), which `surrogateescape` turns back into that byte; any other surrogate (U+D800.., from Python code) it
    cannot encode."""
    return all(0xDC80 <= ord(c) <= 0xDCFF for c in value if 0xD800 <= ord(c) <= 0xDFFF)


def check_model(name: str, value, error: type[ParseJaxError] = ConfigError) -> None:
    """A loaded model (anything with a config and params: pj.load_model, pj.load_pair), not None or a path."""
    if value is None or not (hasattr(value, "config") and hasattr(value, "params")):
        raise error(f"{name} must be a model (pj.load_model / pj.load_pair), got {shorten(repr(value))}")


def check_path(name: str, value, error: type[ParseJaxError] = InputError) -> str | os.PathLike:
    """A file or folder path: a non-empty str or os.PathLike."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise error(f"{name} must be a path (a non-empty str or os.PathLike), got {shorten(repr(value))}")
    return value
