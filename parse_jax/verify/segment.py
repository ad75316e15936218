"""Where to cut a draft into candidate prefixes, on the device: the same boundaries as `host_segment.py`'s numpy
segmenters (their reference), computed inside a jitted program from a padded draft [B, D] so that a PARSE round
never leaves the device.

Every segmenter first marks the boundary values it would emit (`marks[b, v]`: a prefix ends after v tokens,
v in 1..D), then `select_boundaries` caps them at `max_prefixes` exactly as `host_segment.cap_boundaries` does.
Delimiters are matched by a token automaton (`DelimiterTable`): a scan over the draft with one table lookup per
token, leftmost non-overlapping occurrences like `host_segment.delimiter_boundaries`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.settings import SEGMENTERS, Segmenter


@dataclasses.dataclass(frozen=True, eq=False)
class DelimiterTable:
    """A delimiter matcher as a transition table over token ids: `table[state, token] = 2 * next_state + ends`,
    where `ends` says an occurrence of the delimiter ends at that token. After an occurrence the state is 0 again,
    so occurrences never overlap (the numpy segmenter's leftmost, non-overlapping scan)."""

    table: np.ndarray  # int32 [num_states, vocab]

    @classmethod
    def from_ids(cls, delimiter: Sequence[int], vocab_size: int) -> DelimiterTable:
        """The KMP automaton of a token-id delimiter: state s = the first s delimiter tokens were just seen."""
        delim = [int(t) for t in delimiter]
        if not delim:
            raise ConfigError("the delimiter is empty")
        if any(not 0 <= t < vocab_size for t in delim):
            raise ConfigError(f"delimiter ids {delim} lie outside the vocabulary [0, {vocab_size})")
        n = len(delim)
        fail = [0] * n  # KMP failure function: longest proper border of delim[:s + 1]
        for s in range(1, n):
            f = fail[s - 1]
            while f and delim[s] != delim[f]:
                f = fail[f - 1]
            fail[s] = f + (delim[s] == delim[f])
        table = np.zeros((n, vocab_size), np.int32)  # any token not in the delimiter: back to state 0
        for s in range(n):
            for c in set(delim):
                f = s
                while f and delim[f] != c:
                    f = fail[f - 1]
                nxt = f + (delim[f] == c)
                table[s, c] = 1 if nxt == n else 2 * nxt
        return cls(table)

    @classmethod
    def from_texts(cls, token_texts: Sequence[str], delimiters: Sequence[str], vocab_size: int) -> DelimiterTable:
        """Delimiters matched in the decoded text (`host_segment.text_delimiter_boundaries`): a character automaton
        run over each token's text from every state; `ends` when an occurrence ends inside the token, after which the
        automaton restarts (occurrences never overlap). Tokens past `token_texts` (padded rows) are empty text."""
        delimiters = [str(d) for d in delimiters]
        if not delimiters or any(not d for d in delimiters):
            raise ConfigError(f"delimiters must be non-empty strings, got {delimiters!r}")
        goto, ends = text_automaton(delimiters)
        n = len(goto)
        alphabet = set(goto[0])
        table = np.zeros((n, vocab_size), np.int32)  # a token with none of the delimiters' characters: state 0
        for t in range(vocab_size):
            text = token_texts[t] if t < len(token_texts) else ""
            if not text:  # empty text (special tokens, padding) leaves the state as it is
                table[:, t] = 2 * np.arange(n)
                continue
            if not alphabet.intersection(text):
                continue
            for s0 in range(n):
                s, hit = s0, False
                for ch in text:
                    s = goto[s].get(ch, 0)
                    if ends[s]:
                        s, hit = 0, True
                table[s0, t] = 2 * s + hit
        if not (table % 2).any():
            raise ConfigError(f"no token of this tokenizer can complete the delimiter(s) {delimiters!r}: "
                              "they never occur in its text")
        return cls(table)

    def completing_ids(self) -> np.ndarray:
        """Tokens that complete a delimiter from the start state: where a step ends when the target writes one."""
        return np.flatnonzero(self.table[0] % 2 == 1).astype(np.int32)


def text_automaton(delimiters: Sequence[str]) -> tuple[list[dict[str, int]], list[bool]]:
    """Aho-Corasick over the delimiters' characters: (goto[state][char] -> state, with failure links folded in;
    ends[state]: some delimiter is a suffix of the text this state stands for)."""
    goto: list[dict[str, int]] = [{}]
    ends = [False]
    for d in delimiters:
        s = 0
        for ch in d:
            if ch not in goto[s]:
                goto.append({})
                ends.append(False)
                goto[s][ch] = len(goto) - 1
            s = goto[s][ch]
        ends[s] = True
    fail = [0] * len(goto)
    order = list(goto[0].values())
    for s in order:  # breadth first: a state's failure is decided before its children's
        for ch, t in goto[s].items():
            order.append(t)
            f = fail[s]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[t] = goto[f][ch] if ch in goto[f] and goto[f][ch] != t else 0
            ends[t] = ends[t] or ends[fail[t]]
    alphabet = {ch for d in delimiters for ch in d}
    full: list[dict[str, int]] = []
    for s in range(len(goto)):
        row = {}
        for ch in alphabet:
            f = s
            while f and ch not in goto[f]:
                f = fail[f]
            row[ch] = goto[f].get(ch, 0)
        full.append(row)
    return full, ends


def delimiter_scan(tokens: jax.Array, table: jax.Array, start: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The automaton run over each row's tokens [B, T] from `start` [B] (default: state 0): (the state after each
    token [B, T], whether a delimiter occurrence ends at it [B, T])."""
    b = tokens.shape[0]

    def step(state, tok):
        entry = table[state, tok]
        return entry // 2, (entry // 2, entry % 2 == 1)

    start = jnp.zeros((b,), jnp.int32) if start is None else start
    _, (states, ends) = jax.lax.scan(step, start, tokens.T)  # [T, B]
    return states.T, ends.T


def state_after(tokens: jax.Array, count: jax.Array, table: jax.Array, start: jax.Array) -> jax.Array:
    """The automaton's state [B] after each row's first `count` tokens, from `start` (multi round: the state carried
    from the output before them into the target's step)."""
    states, _ = delimiter_scan(tokens, table, start)
    at = jnp.take_along_axis(states, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(count > 0, at, start)


def delimiter_marks(draft: jax.Array, draft_len: jax.Array, table: jax.Array) -> jax.Array:
    """Bool [B, D + 1]: marks[b, v] when a delimiter occurrence ends at draft token v - 1 (v <= draft_len)."""
    b, d = draft.shape
    _, ends = delimiter_scan(draft, table)
    v = jnp.arange(1, d + 1)[None, :]
    marks = ends & (v <= draft_len[:, None])
    return jnp.concatenate([jnp.zeros((b, 1), bool), marks], axis=1)


def stride_marks(draft_len: jax.Array, d: int, stride: int) -> jax.Array:
    """Bool [B, D + 1]: every `stride` tokens below the draft's length."""
    v = jnp.arange(d + 1)[None, :]
    return (v > 0) & (v % stride == 0) & (v < draft_len[:, None])


def with_full_draft(marks: jax.Array, draft_len: jax.Array) -> jax.Array:
    """The full draft is always the last prefix (the whole-draft check)."""
    v = jnp.arange(marks.shape[1])[None, :]
    return (marks & (v <= draft_len[:, None])) | (v == draft_len[:, None])


def hybrid_marks(delim_marks: jax.Array, draft_len: jax.Array, min_len: int, max_len: int) -> jax.Array:
    """`host_segment.hybrid_boundaries` on marks: delimiter segments shorter than `min_len` merged into the next, then
    segments longer than `max_len` split into equal pieces (piece i ends at start + i * length // pieces)."""
    b, width = delim_marks.shape
    cand = with_full_draft(delim_marks, draft_len)

    def merge(start, v):
        keep = cand[:, v] & ((v - start >= min_len) | (v == draft_len))
        return jnp.where(keep, v, start), keep

    _, kept = jax.lax.scan(merge, jnp.zeros((b,), jnp.int32), jnp.arange(width))
    kept = kept.T  # [B, D + 1]
    v = jnp.broadcast_to(jnp.arange(width)[None, :], (b, width))
    # the kept segment (start, end] that holds v: start = last kept value < v, end = first kept value >= v
    start = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                             jax.lax.cummax(jnp.where(kept, v, 0), axis=1)[:, :-1]], axis=1)
    end = jax.lax.cummin(jnp.where(kept, v, width), axis=1, reverse=True)
    length = jnp.maximum(end - start, 1)
    pieces = -(-length // max_len)
    r = v - start
    i = -(-r * pieces // length)  # the only piece that could end at v
    split = (v > 0) & (v < end) & (end < width) & (i <= pieces - 1) & ((i * length) // pieces == r)
    return kept | split


def select_boundaries(marks: jax.Array, max_prefixes: int) -> tuple[jax.Array, jax.Array]:
    """(boundaries [B, K] ascending, count [B]): the marked values capped at K = `max_prefixes` as
    `host_segment.cap_boundaries` caps them (the last always kept, the rest spread by `host_segment.cap_picks`);
    entries past `count` are 0."""
    b, width = marks.shape
    k = max_prefixes
    n = marks.sum(axis=1).astype(jnp.int32)
    rank = jnp.cumsum(marks, axis=1) - 1
    v = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], (b, width))
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, width))
    ranked = jnp.zeros((b, width), jnp.int32).at[rows, jnp.where(marks, rank, width)].set(v, mode="drop")
    last = jnp.take_along_axis(ranked, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    if k == 1:
        return last[:, None], jnp.minimum(n, 1)
    idx = jnp.arange(k, dtype=jnp.int32)[None, :]
    if k == 2:
        picks = jnp.zeros((b, k), jnp.int32)
    else:
        head = n[:, None] - 1
        picks = (2 * idx * (head - 1) + (k - 2)) // (2 * (k - 2))
    capped = jnp.where(idx < k - 1, jnp.take_along_axis(ranked, jnp.clip(picks, 0, width - 1), axis=1),
                       last[:, None])
    plain = jnp.take_along_axis(ranked, jnp.minimum(idx, width - 1), axis=1)
    count = jnp.minimum(n, k)
    bounds = jnp.where((n > k)[:, None], capped, jnp.where(idx < count[:, None], plain, 0))
    return bounds, count


def _step_lowest(marks: jax.Array, probs: jax.Array, draft_len: jax.Array) -> jax.Array:
    """Float [B, D + 2]: per step s (the tokens after s marks), the lowest probability the draft gave one of its
    tokens; +inf for a step with no token."""
    b, width = marks.shape
    d = width - 1
    t = jnp.arange(d)[None, :]
    seg = jnp.cumsum(marks[:, :d], axis=1)  # the step of token t: how many marks lie at values <= t
    p = jnp.where(t < draft_len[:, None], probs[:, :d].astype(jnp.float32), jnp.inf)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, d))
    return jnp.full((b, width + 1), jnp.inf, jnp.float32).at[rows, seg].min(p)


def next_step_confidence(marks: jax.Array, probs: jax.Array, draft_len: jax.Array) -> jax.Array:
    """Float [B, D + 1]: at each marked value v, the lowest probability the draft gave a token of the step that
    follows (tokens v up to the next mark); +inf where nothing follows (the full draft) or v is not marked."""
    return _next_step(marks, _step_lowest(marks, probs, draft_len))


def _next_step(marks: jax.Array, lowest: jax.Array) -> jax.Array:
    """`next_step_confidence` from `_step_lowest`'s figures."""
    rank = jnp.cumsum(marks, axis=1)  # at a mark v: the step that starts there
    return jnp.where(marks, jnp.take_along_axis(lowest, rank, axis=1), jnp.inf)


def _held_log(marks: jax.Array, q: jax.Array) -> jax.Array:
    """Float [B, D + 1]: at each marked value v, log P(every step inside draft[:v] holds), a step held with the
    probability of its least likely token (`q`: `_step_lowest`'s figures, the draft's own confidence)."""
    log_q = jnp.log(jnp.clip(jnp.where(jnp.isinf(q), 1.0, q), 1e-30, 1.0))
    upto = jnp.cumsum(log_q, axis=1)  # log P(steps 0..s hold)
    rank = jnp.cumsum(marks, axis=1) - 1  # at a mark v: the last step inside draft[:v]
    return jnp.take_along_axis(upto, jnp.maximum(rank, 0), axis=1)


def prefix_values(marks: jax.Array, held: jax.Array, chosen: jax.Array) -> jax.Array:
    """Float [B, D + 1]: at each marked value v, the draft tokens that verifying draft[:v] too is expected to keep
    beyond the ends already `chosen` (the full draft always among them): with u the nearest chosen end below v (0 if
    none) and w the nearest above, (v - u) x P(every step up to v holds) x P(a step in (v, w] fails); `held` from
    `_held_log`. Against the full draft alone that is v x P(steps up to v hold) x P(a later step fails)."""
    width = marks.shape[1]
    pos = jnp.arange(width, dtype=jnp.int32)[None, :]
    u = jax.lax.cummax(jnp.where(chosen, pos, 0), axis=1)
    w = jax.lax.cummin(jnp.where(chosen, pos, width - 1), axis=1, reverse=True)
    held_w = jnp.take_along_axis(held, w, axis=1)
    value = (pos - u).astype(jnp.float32) * jnp.exp(held) * (1.0 - jnp.exp(held_w - held))
    return jnp.where(marks & ~chosen, value, 0.0)


def _pick_ends(eligible: jax.Array, key: jax.Array, draft_len: jax.Array,
               max_prefixes: int) -> tuple[jax.Array, jax.Array]:
    """(boundaries [B, K] ascending, count [B]): the full draft and the K - 1 eligible values of lowest `key` (the
    earliest first on ties); entries past `count` are 0."""
    b, width = eligible.shape
    k = max_prefixes
    order = jnp.argsort(jnp.where(eligible, key, jnp.inf), axis=1, stable=True)[:, :k - 1]
    picked = jnp.take_along_axis(eligible, order, axis=1)
    chosen = jnp.sort(jnp.where(picked, order, width), axis=1)
    chosen = jnp.pad(chosen, ((0, 0), (0, max(0, k - chosen.shape[1]))), constant_values=width)[:, :k]
    n_head = picked.sum(axis=1).astype(jnp.int32)
    idx = jnp.arange(k)[None, :]
    bounds = jnp.where(idx < n_head[:, None], chosen, jnp.where(idx == n_head[:, None], draft_len[:, None], 0))
    return bounds.astype(jnp.int32), n_head + 1


def select_by_confidence(marks: jax.Array, confidence: jax.Array, draft_len: jax.Array, max_prefixes: int,
                         cutoff: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(boundaries [B, K] ascending, count [B]) as `host_segment.confidence_boundaries` picks them: the full draft,
    and of the other marked values whose following step's least likely token is at most `cutoff` likely, the K - 1
    least confident (the earliest first on ties); entries past `count` are 0."""
    if max_prefixes == 1:
        return draft_len[:, None], jnp.ones((marks.shape[0],), jnp.int32)
    v = jnp.arange(marks.shape[1])[None, :]
    eligible = marks & (v != draft_len[:, None]) & (confidence <= cutoff)
    return _pick_ends(eligible, confidence, draft_len, max_prefixes)


def select_by_value(marks: jax.Array, probs: jax.Array, draft_len: jax.Array, max_prefixes: int, *,
                    cutoff: float = 1.0, price: jax.Array | float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(boundaries [B, K] ascending, count [B]) as `host_segment.value_boundaries` picks them (prefix_choice
    "auto"): the full draft, then up to K - 1 times the marked value of highest `prefix_values` given the ends
    already kept (the earliest on ties), among those whose following step passes `cutoff`, while that value reaches
    `price` (the draft tokens a suffix copy costs, traced); entries past `count` are 0."""
    if max_prefixes == 1:
        return draft_len[:, None], jnp.ones((marks.shape[0],), jnp.int32)
    b, width = marks.shape
    pos = jnp.arange(width)[None, :]
    lowest = _step_lowest(marks, probs, draft_len)
    held = _held_log(marks, lowest)
    full = pos == draft_len[:, None]
    eligible = marks & ~full & (_next_step(marks, lowest) <= cutoff)
    chosen = full
    for _ in range(max_prefixes - 1):  # greedy on the marginal value: K - 1 static steps
        value = prefix_values(marks, held, chosen)
        pays = eligible & ~chosen & (value >= price)
        best = jnp.argmax(jnp.where(pays, value, -jnp.inf), axis=1)
        chosen = chosen | ((pos == best[:, None]) & pays.any(axis=1)[:, None])
    return _pick_ends(chosen & ~full, jnp.zeros((b, width), jnp.float32), draft_len, max_prefixes)


def segment_marks(draft: jax.Array, draft_len: jax.Array, segmenter: Segmenter, table: jax.Array | None = None,
                  stride: int = 8, min_segment: int = 4, max_segment: int = 32) -> jax.Array:
    """Bool [B, D + 1]: every value `segmenter` would cut each row's draft[:draft_len] at, the full draft included."""
    d = draft.shape[1]
    if segmenter == "stride":
        marks = stride_marks(draft_len, d, stride)
    elif segmenter == "delimiter":
        marks = delimiter_marks(draft, draft_len, table)
    elif segmenter == "hybrid":
        marks = hybrid_marks(delimiter_marks(draft, draft_len, table), draft_len, min_segment, max_segment)
    else:
        raise ConfigError(f"unknown segmenter {segmenter!r}; available: {', '.join(SEGMENTERS)}")
    return with_full_draft(marks, draft_len)


def segment(draft: jax.Array, draft_len: jax.Array, segmenter: Segmenter, max_prefixes: int,
            table: jax.Array | None = None, stride: int = 8, min_segment: int = 4,
            max_segment: int = 32) -> tuple[jax.Array, jax.Array]:
    """(boundaries [B, K], count [B]) of each row's draft[:draft_len] by `segmenter` (draft_len >= 1), capped at K
    spread evenly."""
    marks = segment_marks(draft, draft_len, segmenter, table, stride, min_segment, max_segment)
    return select_boundaries(marks, max_prefixes)
