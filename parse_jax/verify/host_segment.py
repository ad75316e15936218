"""Where to cut a draft into candidate prefixes, on the host in numpy: `ParseEngine.boundaries`, and the reference
the device segmenter (`segment.py`, which a PARSE round runs) is property-tested against (tests/verify/test_segment.py).

Boundaries are token counts: prefix k is `draft[:b_k]`, 0 < b_1 < ... < b_K <= D, and the full draft is always the
last prefix (the whole-draft check). The packed block itself is built on the device (`block.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parse_jax.errors import InputError
from parse_jax.utils.validation import check_draft


def delimiter_boundaries(draft: Sequence[int], delimiter: Sequence[int]) -> list[int]:
    """Ends of the delimiter occurrences (each prefix keeps its delimiter), then the full draft."""
    draft = list(draft)
    check_draft(len(draft))
    delimiter = list(delimiter)
    if not delimiter:
        raise InputError("the delimiter is empty")
    n, out, i = len(delimiter), [], 0
    while i + n <= len(draft):
        if draft[i:i + n] == delimiter:
            out.append(i + n)
            i += n
        else:
            i += 1
    if not out or out[-1] != len(draft):
        out.append(len(draft))
    return out


def text_delimiter_boundaries(token_texts: Sequence[str], delimiters: Sequence[str]) -> list[int]:
    """Boundaries from the decoded text: after every token whose text completes a delimiter occurrence (the
    earliest-ending occurrence of any delimiter after the previous one ends; occurrences never overlap), then the
    full draft. `token_texts`: the draft's tokens' texts, in order."""
    check_draft(len(token_texts))
    delimiters = [d for d in delimiters]
    if not delimiters or any(not d for d in delimiters):
        raise InputError(f"delimiters must be non-empty strings, got {delimiters!r}")
    out, text, start = [], "", 0
    for t, piece in enumerate(token_texts):
        for ch in piece:
            text += ch
            if any(text.endswith(d) and len(text) - len(d) >= start for d in delimiters):
                start = len(text)
                if not out or out[-1] != t + 1:
                    out.append(t + 1)
    if not out or out[-1] != len(token_texts):
        out.append(len(token_texts))
    return out


def stride_boundaries(draft_len: int, stride: int) -> list[int]:
    """Every `stride` tokens, then the full draft."""
    check_draft(draft_len)
    if stride < 1:
        raise InputError(f"stride must be >= 1, got {stride}")
    out = list(range(stride, draft_len, stride))
    return out + [draft_len]


def hybrid_boundaries(draft: Sequence[int], delimiter: Sequence[int], min_len: int, max_len: int) -> list[int]:
    """Delimiter boundaries, with segments shorter than `min_len` merged into the next and segments
    longer than `max_len` split into equal pieces (so a split never leaves a sliver)."""
    return hybrid_from_boundaries(delimiter_boundaries(draft, delimiter), len(draft), min_len, max_len)


def hybrid_from_boundaries(delimited: Sequence[int], draft_len: int, min_len: int, max_len: int) -> list[int]:
    """`hybrid_boundaries` from delimiter boundaries found any way (token ids or decoded text)."""
    if not 1 <= min_len <= max_len:
        raise InputError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    merged, start = [], 0
    for b in delimited:
        if b - start >= min_len or b == draft_len:
            merged.append(b)
            start = b
    out, start = [], 0
    for b in merged:
        pieces = -(-(b - start) // max_len)
        out.extend(start + (i * (b - start)) // pieces for i in range(1, pieces))
        out.append(b)
        start = b
    return out


def cap_boundaries(boundaries: Sequence[int], max_prefixes: int) -> list[int]:
    """At most `max_prefixes`, spread evenly over the candidates; the last (full draft) is always kept."""
    if max_prefixes < 1:
        raise InputError(f"max_prefixes must be >= 1, got {max_prefixes}")
    b = list(boundaries)
    if len(b) <= max_prefixes:
        return b
    head = b[:-1]
    return [head[i] for i in cap_picks(len(head), max_prefixes)] + [b[-1]]


def cap_picks(num_head: int, max_prefixes: int) -> list[int]:
    """Indices of the `max_prefixes - 1` head candidates kept out of `num_head` (> that many): evenly spread from the
    first to the last, rounded half up, in integers so that the device segmenter (`segment.py`) picks the same."""
    k = max_prefixes - 1
    if k <= 0:
        return []
    if k == 1:
        return [0]
    return [(2 * i * (num_head - 1) + (k - 1)) // (2 * (k - 1)) for i in range(k)]


def confidence_boundaries(boundaries: Sequence[int], probs: Sequence[float], max_prefixes: int,
                          cutoff: float = 1.0) -> list[int]:
    """The full draft (the last boundary) and at most `max_prefixes - 1` of the others: those whose following step
    (up to the next boundary) holds the least likely draft token, among those where it is at most `cutoff` likely;
    the earliest first on ties. Verifying the prefix before a step the draft doubts keeps what precedes it when that
    step is wrong. `probs[t]`: the draft's probability of its token t."""
    if max_prefixes < 1:
        raise InputError(f"max_prefixes must be >= 1, got {max_prefixes}")
    b = list(boundaries)
    head = [(min(float(p) for p in probs[v:b[i + 1]]), v) for i, v in enumerate(b[:-1])]
    cut = float(np.float32(cutoff))  # as the device compares it
    picked = sorted((c, v) for c, v in head if c <= cut)[:max_prefixes - 1]
    return sorted(v for _, v in picked) + [b[-1]]


def value_boundaries(boundaries: Sequence[int], probs: Sequence[float], max_prefixes: int, cutoff: float = 1.0,
                     price: float = 0.0) -> list[int]:
    """The full draft (the last boundary) and at most `max_prefixes - 1` of the others (prefix_choice "auto"),
    greedily: each time the end of highest marginal value (the earliest on ties) among those whose following step's
    least likely token is at most `cutoff` likely, while that value reaches `price` (the draft tokens one more suffix
    copy costs at this batch). The marginal value of draft[:v], with u the nearest kept end below v (0 if none) and w
    the nearest above, is the draft tokens it is expected to keep beyond them: (v - u) x P(every step up to v holds)
    x P(a step in (v, w] fails), a step held with the probability of its least likely token."""
    if max_prefixes < 1:
        raise InputError(f"max_prefixes must be >= 1, got {max_prefixes}")
    b = list(boundaries)
    starts = [0, *b[:-1]]
    held = [np.float32(min((float(p) for p in probs[s:e]), default=1.0)) for s, e in zip(starts, b)]
    log_q = np.log(np.clip(np.asarray(held, np.float32), np.float32(1e-30), np.float32(1.0)))
    upto = np.cumsum(log_q, dtype=np.float32)  # upto[i]: log P(steps 0..i hold), the steps inside draft[:b[i]]
    cut, price = float(np.float32(cutoff)), float(np.float32(price))  # as the device compares them
    eligible = [i for i in range(len(b) - 1) if held[i + 1] <= cut]
    kept = {len(b) - 1}
    for _ in range(max_prefixes - 1):
        best, best_value = None, -np.inf
        for i in eligible:
            if i in kept:
                continue
            u = max((b[j] for j in kept if j < i), default=0)
            w = min(j for j in kept if j > i)
            value = float(np.float32(b[i] - u) * np.exp(upto[i]) * (np.float32(1.0) - np.exp(upto[w] - upto[i])))
            if value >= price and value > best_value:
                best, best_value = i, value
        if best is None:
            break
        kept.add(best)
    return sorted(b[i] for i in kept)
