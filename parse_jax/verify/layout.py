"""Where to cut a draft into candidate prefixes, and the packed verification block of docs/design.md §2.

Pure numpy: the engine calls these on the host, the model only ever sees `tokens`, `positions`,
`limit` and `group`. Boundaries are token counts: prefix k is `draft[:b_k]`, 0 < b_1 < ... < b_K <= D,
and the full draft is always the last prefix (the whole-draft check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from parse_jax.errors import InputError

PAD_GROUP = -1  # packed padding: no query may see it (group 0 is the draft, k >= 1 the copies)


def _check_draft(draft_len: int) -> None:
    if draft_len < 1:
        raise InputError("the draft is empty: nothing to verify")


def delimiter_boundaries(draft: Sequence[int], delimiter: Sequence[int]) -> list[int]:
    """Ends of the delimiter occurrences (each prefix keeps its delimiter), then the full draft."""
    draft = list(draft)
    _check_draft(len(draft))
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
    _check_draft(len(token_texts))
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
    _check_draft(draft_len)
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


def check_boundaries(boundaries: Sequence[int], draft_len: int) -> list[int]:
    """Boundaries as a validated list: strictly increasing, within (0, draft_len]."""
    _check_draft(draft_len)
    b = [int(x) for x in boundaries]
    if not b:
        raise InputError("no boundaries given: need at least one prefix to verify")
    if b[0] <= 0 or b[-1] > draft_len:
        raise InputError(f"boundaries must lie in (0, {draft_len}] for a draft of {draft_len} tokens, got {b}")
    if any(x >= y for x, y in zip(b, b[1:])):
        raise InputError(f"boundaries must be strictly increasing, got {b}")
    return b


@dataclasses.dataclass(frozen=True)
class PackedBlock:
    """One request's verification block: draft then K suffix copies (docs/design.md §2). All int32 [T]."""

    tokens: np.ndarray
    positions: np.ndarray
    limit: np.ndarray
    group: np.ndarray
    score_index: np.ndarray  # [K]: the last token of each copy, where the judge words are read
    draft_len: int

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def pack(context_len: int, draft: Sequence[int], boundaries: Sequence[int], suffix: Sequence[int]) -> PackedBlock:
    """Draft token t: position C + t, sees the context and draft tokens <= t.
    Copy k token j: position C + b_k + j, sees the context, draft tokens < b_k and copy-k tokens <= j."""
    draft = np.asarray(draft, np.int32)
    d = int(draft.shape[0])
    b = check_boundaries(boundaries, d)
    suffix = np.asarray(suffix, np.int32)
    s = int(suffix.shape[0])
    if s < 1:
        raise InputError("the verification suffix is empty")
    if context_len < 0:
        raise InputError(f"context length must be >= 0, got {context_len}")
    k = len(b)
    bounds = np.asarray(b, np.int32)
    tokens = np.concatenate([draft, np.tile(suffix, k)])
    j = np.tile(np.arange(s, dtype=np.int32), k)
    positions = np.concatenate([context_len + np.arange(d, dtype=np.int32), context_len + np.repeat(bounds, s) + j])
    limit = np.concatenate([np.arange(1, d + 1, dtype=np.int32), np.repeat(bounds, s)])
    group = np.concatenate([np.zeros(d, np.int32), np.repeat(np.arange(1, k + 1, dtype=np.int32), s)])
    score_index = d + s * np.arange(1, k + 1, dtype=np.int32) - 1
    return PackedBlock(tokens.astype(np.int32), positions.astype(np.int32), limit, group, score_index, d)


def pad_blocks(blocks: Sequence[PackedBlock], length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Stack blocks into [B, length] arrays; padding is group PAD_GROUP / limit 0, invisible to every query."""
    if not blocks:
        raise InputError("no blocks to pad")
    longest = max(blk.length for blk in blocks)
    if length < longest:
        raise InputError(f"pad length {length} is shorter than the longest block ({longest} tokens)")
    b = len(blocks)
    out = {
        "tokens": np.full((b, length), pad_id, np.int32),
        "positions": np.zeros((b, length), np.int32),
        "limit": np.zeros((b, length), np.int32),
        "group": np.full((b, length), PAD_GROUP, np.int32),
    }
    for i, blk in enumerate(blocks):
        n = blk.length
        out["tokens"][i, :n] = blk.tokens
        out["positions"][i, :n] = blk.positions
        out["positions"][i, n:] = blk.positions[-1]
        out["limit"][i, :n] = blk.limit
        out["group"][i, :n] = blk.group
    return out
