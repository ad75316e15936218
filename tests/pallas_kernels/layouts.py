"""Hypothesis strategies for attention metadata at a fixed shape (so a kernel compiles once per shape).

Rows are packed verification blocks built with `tests.verify.layout_reference.pack` / `pad_blocks` (cache length, draft
length, K, suffix length, padding all drawn), plain causal prefills (K = 0), or, with `arbitrary=True`,
metadata with no structure at all (the kernels and the block map must not rely on contiguous groups).
Some draft rows may get `limit = 0` ("blind"): with an empty context they see nothing and must give zeros.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tests.verify.layout_reference import pack, pad_blocks


def rule_mask(ctx_len, limit, group, num_slots, padded_slots=None):
    """[T, padded_slots] visibility by the letter of docs/design.md §2, token by token (the tests' statement of the
    rule); slots at or past num_slots (a kernel's tail) see nothing. padded_slots defaults to num_slots."""
    t = len(limit)
    mask = np.zeros((t, num_slots if padded_slots is None else padded_slots), bool)
    for i in range(t):
        for s in range(num_slots):
            j = s - ctx_len
            if s < ctx_len:
                mask[i, s] = True
            elif j < t:
                mask[i, s] = bool((group[j] == 0 and j < limit[i]) or (group[j] == group[i] != 0 and j <= i))
    return mask


@st.composite
def packed_row(draw, t: int, num_slots: int):
    ctx = draw(st.integers(0, num_slots - t))
    k = draw(st.integers(0, 4))
    s = draw(st.integers(1, 4))
    d = draw(st.integers(1, max(1, t - k * s))) if k * s < t else None
    if d is None:  # too many copies for this block: fall back to a plain causal prefill
        k, d = 0, draw(st.integers(1, t))
    if k == 0:
        limit = np.zeros(t, np.int32)
        limit[:d] = np.arange(1, d + 1)
        group = np.full(t, -1, np.int32)
        group[:d] = 0
    else:
        bounds = sorted(draw(st.sets(st.integers(1, d), min_size=1, max_size=min(k, d))))
        block = pack(ctx, np.arange(d), bounds, np.arange(s))
        arrays = pad_blocks([block], t)
        limit, group = arrays["limit"][0], arrays["group"][0]
    if draw(st.booleans()):
        blind = draw(st.lists(st.integers(0, t - 1), max_size=4))
        for i in blind:
            if group[i] == 0:
                limit[i] = 0
    return ctx, limit, group


@st.composite
def arbitrary_row(draw, t: int, num_slots: int):
    ctx = draw(st.integers(0, num_slots - t))
    limit = np.asarray(draw(st.lists(st.integers(0, t), min_size=t, max_size=t)), np.int32)
    group = np.asarray(draw(st.lists(st.integers(-1, 3), min_size=t, max_size=t)), np.int32)
    return ctx, limit, group


@st.composite
def metadata(draw, batch: int, t: int, num_slots: int, arbitrary: bool = False):
    """(lengths [B], limit [B, T], group [B, T]) as int32 numpy arrays."""
    row = arbitrary_row if arbitrary else packed_row
    rows = [draw(row(t, num_slots)) for _ in range(batch)]
    if draw(st.booleans()):  # an empty context makes blind rows see nothing at all
        rows = [(0, limit, group) for _, limit, group in rows]
    lengths = np.array([r[0] for r in rows], np.int32)
    return lengths, np.stack([r[1] for r in rows]), np.stack([r[2] for r in rows])
