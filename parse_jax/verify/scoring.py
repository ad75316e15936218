"""Single-pass prefix verification: one target pass over cache + packed block, judge scores, acceptance.

The pass writes the block's KV into the cache; the draft's slots come first, so committing `b` tokens
keeps exactly the accepted prefix's KV (computed in that same pass) and drops every suffix copy.
The target's next-token logits after each boundary come from the same pass too (draft token b - 1).
Every pass packs its block on the device (`block.pack_block`) and scores it with `verify_block`: the modes' rounds
and `score_prefixes` (`ParseEngine.prefix_scores`) alike.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder
from parse_jax.runtime.programs import bucket, forward_fn, register_program, to_host
from parse_jax.settings import POLICIES
from parse_jax.verify.block import pack_block


def judge_ids(tokenizer, yes: str, no: str) -> tuple[int, int, list[int]]:
    """(yes id, no id, shared tokens): how the judge words are scored. Words of several tokens are scored by their
    first tokens that differ, after the tokens they share (e.g. a leading space token), which the caller appends to
    the verification suffix: the ratio of the two words' probabilities at the point where they part, still read from
    the one pass. Words whose tokens never part (one a prefix of the other), special tokens and text outside the
    vocabulary are refused."""
    ids = {}
    for name, word in (("judge_yes", yes), ("judge_no", no)):
        enc = [int(t) for t in tokenizer.encode(word)]
        if not enc:
            raise ConfigError(f"{name} {word!r} encodes to no tokens")
        if tokenizer.has_unknown(enc):
            raise ConfigError(f"{name} {word!r} is not in this tokenizer's vocabulary (it encodes to the unknown "
                              "token): it could not be scored")
        if any(t in tokenizer.special_ids for t in enc):
            raise ConfigError(f"{name} {word!r} contains a special token ({enc}): a judge word must be ordinary text "
                              "the target answers with")
        ids[name] = enc
    y, n = ids["judge_yes"], ids["judge_no"]
    shared = 0
    while shared < min(len(y), len(n)) and y[shared] == n[shared]:
        shared += 1
    if shared == min(len(y), len(n)):
        raise ConfigError(f"judge words {yes!r} and {no!r} encode to {y} and {n}: one is a prefix of the other, so "
                          "no token tells them apart")
    return y[shared], n[shared], y[:shared]


def scores_from_logits(logits: jax.Array, yes_id: int, no_id: int) -> jax.Array:
    """p_yes / (p_yes + p_no) = sigmoid(logit_yes - logit_no): the softmax normaliser cancels."""
    return jax.nn.sigmoid(logits[..., yes_id] - logits[..., no_id])


def passes(scores, threshold):
    """A prefix passes when its score reaches the threshold; a threshold of 1 passes nothing (no score is certain,
    though float32 rounds a confident one to 1.0): threshold 1 is the target alone, 0 accepts every draft."""
    return (scores >= threshold) & (threshold < 1.0)


def accept(scores: np.ndarray, valid: np.ndarray, threshold: float, policy: str = "earliest_error") -> np.ndarray:
    """Index of the accepted prefix per row (-1: none). scores, valid: [B, K] (valid masks padded prefixes).

    `earliest_error`: the prefix just before the first score below threshold.
    `longest_valid`: the longest prefix whose own score clears the threshold.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown acceptance policy {policy!r}; available: {', '.join(POLICIES)}")
    scores, valid = np.asarray(scores), np.asarray(valid, bool)
    ok = np.asarray(passes(scores, threshold)) & valid
    k = scores.shape[-1]
    if policy == "earliest_error":
        fail = ~ok & valid
        first_fail = np.where(fail.any(-1), fail.argmax(-1), k)
        last_valid = np.where(valid.any(-1), k - 1 - valid[..., ::-1].argmax(-1), -1)
        return np.minimum(first_fail - 1, last_valid)
    return np.where(ok.any(-1), k - 1 - ok[..., ::-1].argmax(-1), -1)


def accept_on_device(scores: jax.Array, valid: jax.Array, threshold: jax.Array, policy: str) -> jax.Array:
    """`accept` inside a jitted program (same result; `accept` is its reference)."""
    ok = passes(scores, threshold) & valid
    k = scores.shape[-1]
    if policy == "earliest_error":
        fail = ~ok & valid
        first_fail = jnp.where(fail.any(-1), jnp.argmax(fail, -1), k)
        last_valid = jnp.where(valid.any(-1), k - 1 - jnp.argmax(valid[..., ::-1], -1), -1)
        return jnp.minimum(first_fail - 1, last_valid).astype(jnp.int32)
    if policy == "longest_valid":
        return jnp.where(ok.any(-1), k - 1 - jnp.argmax(ok[..., ::-1], -1), -1).astype(jnp.int32)
    raise ConfigError(f"unknown acceptance policy {policy!r}; available: {', '.join(POLICIES)}")


def verify_block(forward, cache: KVCache, block, yes_id, no_id, taps: tuple[int, ...] = ()):
    """One verification pass inside a jitted program: `forward` (`programs.forward_fn(..., return_hidden=True)`)
    over `cache` + a `block.Block` -> (scores [B, K] (NaN past each row's count), boundary_logits [B, K + 1, V],
    cache with the block written, the tapped features [B, L, len(taps) * d] or None)."""
    logits, cache, hiddens = forward(block.tokens, block.positions, cache, block.limit, block.group)
    at_scores = jnp.take_along_axis(logits, block.score_index[..., None], axis=1)
    scores = jnp.where(block.valid, scores_from_logits(at_scores, yes_id, no_id), jnp.nan)
    boundary_logits = jnp.take_along_axis(logits, block.boundary_index[..., None], axis=1)
    features = jnp.concatenate([hiddens[i] for i in taps], axis=-1) if taps else None
    return scores, boundary_logits, cache, features


def prefix_rows(seqs: Sequence[Sequence[int]], ends: Sequence[Sequence[int]], suffix_len: int,
                rows: int | None = None) -> dict[str, np.ndarray]:
    """The host inputs of prefix scoring, padded to buckets so repeated calls reuse one program: `seq` [R, L]
    (context + draft per request, L = the bucketed longest block, `seq_len` + K * S), `seq_len` [R], `ends` [R, K]
    (prefix ends counted from the start of `seq`, K bucketed) and `count` [R]. Rows past `len(seqs)` (up to `rows`,
    to fill a mesh's `data` axis) are a one-token request with one prefix."""
    n = len(seqs)
    rows = rows or n
    seqs = [list(s) for s in seqs] + [[0]] * (rows - n)
    ends = [list(e) for e in ends] + [[1]] * (rows - n)
    length = bucket(max(len(s) + len(e) * suffix_len for s, e in zip(seqs, ends)))
    k = bucket(max(len(e) for e in ends), 1)
    out = {"seq": np.zeros((rows, length), np.int32), "seq_len": np.array([len(s) for s in seqs], np.int32),
           "ends": np.zeros((rows, k), np.int32), "count": np.array([len(e) for e in ends], np.int32)}
    for i, (s, e) in enumerate(zip(seqs, ends)):
        out["seq"][i, : len(s)] = s
        out["ends"][i, : len(e)] = e
    return out


def prefix_scores_fn(cfg: ModelConfig, attention_impl: str):
    """The prefix-scoring pass, to be jitted (or run under `shard_map`): each row's `seq[:seq_len]` packed with one
    suffix copy per prefix end by `block.pack_block`, one target pass over an empty cache by `verify_block` (the
    code the modes' rounds run) -> scores [R, K] (NaN past each row's count)."""
    module = Decoder(cfg, attention_impl)

    def run(params, seq, seq_len, ends, count, suffix, yes_id, no_id):
        rows, length = seq.shape
        block = pack_block(jnp.zeros((rows,), jnp.int32), seq, seq_len, ends, count, suffix, length)
        cache = KVCache.init(cfg, rows, length)
        scores, _, _, _ = verify_block(forward_fn(module, params, return_hidden=True), cache, block, yes_id, no_id)
        return scores

    return run


@functools.cache
def prefix_scores_program(cfg: ModelConfig, attention_impl: str):
    return register_program(jax.jit(prefix_scores_fn(cfg, attention_impl)))


def score_prefixes(model, seqs: Sequence[Sequence[int]], ends: Sequence[Sequence[int]], *, suffix: Sequence[int],
                   yes_id: int, no_id: int) -> list[np.ndarray]:
    """Judge score of each prefix `seqs[i][:e]`, e in `ends[i]`, every request in ONE pass on one device (inputs
    already validated; `ParseEngine.prefix_scores` checks them). Float64 [K_i] per request."""
    arrays = prefix_rows(seqs, ends, len(suffix))
    program = prefix_scores_program(model.config, model.attention_impl)
    scores = to_host(program(model.params, arrays["seq"], arrays["seq_len"], arrays["ends"], arrays["count"],
                             np.asarray(suffix, np.int32), np.int32(yes_id), np.int32(no_id)))
    return [scores[i, : len(e)].astype(np.float64) for i, e in enumerate(ends)]
