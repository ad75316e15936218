"""Final-answer extraction for GSM8K-style outputs: `#### N`, else the last `\\boxed{...}`, else the last number;
and lm-evaluation-harness's two gsm8k scorings beside it: strict-match (`#### N`) and flexible-extract (the last
number).

Numbers are compared exactly as fractions, so "1,000", "$1000.00" and "1000" are the same answer and
"0.5" equals "\\frac{1}{2}". A text with no number has no answer (None), which grades wrong.
"""

from __future__ import annotations

import re
from fractions import Fraction

# The instruction GSM8K-style prompts end with; extract_answer reads the \boxed{} it asks for.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# An optional sign, an optional "$", then 1,234,567 or 1234567, then an optional decimal part.
# Not preceded by a letter, digit or "." (so "x2" and the "5" of ".5" are no numbers of their own).
_NUMBER = re.compile(r"(?<![\w.])(?P<sign>[-\u2212]\s?)?\$?\s?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(-?\d+)\s*\}")
_SLASH = re.compile(r"^\s*(-?\d+)\s*/\s*(-?\d+)\s*$")
_MARK = "####"


def numbers(text: str) -> list[Fraction]:
    """Every number in `text`, in order."""
    out = []
    for m in _NUMBER.finditer(text):
        value = Fraction(m.group("int").replace(",", "") + (m.group("frac") or ""))
        out.append(-value if m.group("sign") else value)
    return out


def last_number(text: str) -> Fraction | None:
    found = numbers(text)
    return found[-1] if found else None


def boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced), None when there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _value(fragment: str) -> Fraction | None:
    """A number written as \\frac{a}{b}, a/b, or plain (the last number in the fragment)."""
    m = _FRAC.search(fragment) or _SLASH.match(fragment)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return last_number(fragment)


def extract_answer(text: str) -> Fraction | None:
    """A model's final answer: the number after the last `####`, else in the last `\\boxed{}`, else the last number."""
    if _MARK in text:
        found = numbers(text[text.rfind(_MARK) + len(_MARK):])
        if found:
            return found[0]
    inside = boxed(text)
    if inside is not None:
        value = _value(inside)
        if value is not None:
            return value
    return last_number(text)


# lm-evaluation-harness's gsm8k filters: strict-match reads the number after "#### " (its first match),
# flexible-extract the last number in the output.
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def strict_answer(text: str) -> Fraction | None:
    """lm-eval's gsm8k strict-match: the number written right after the first `#### ` (None without one)."""
    m = _STRICT.search(text)
    if m is None:
        return None
    found = numbers(m.group(1).rstrip(".,"))
    return found[0] if found else None


def flexible_answer(text: str) -> Fraction | None:
    """lm-eval's gsm8k flexible-extract: the last number in the output."""
    return last_number(text)


def reference_answer(answer: str) -> Fraction | None:
    """The reference of a GSM8K record: the number after its last `####` (None when there is none)."""
    if _MARK not in answer:
        return None
    found = numbers(answer[answer.rfind(_MARK) + len(_MARK):])
    return found[0] if found else None


def format_number(x: Fraction | None) -> str | None:
    """A JSON-friendly rendering: an integer, a finite decimal, or a/b."""
    if x is None:
        return None
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:
        s = f"{float(x):.12f}".rstrip("0").rstrip(".")
        if Fraction(s) == x:
            return s
    return f"{x.numerator}/{x.denominator}"
