"""Single-pass prefix verification: one target pass over cache + packed block, judge scores, acceptance.

The pass writes the block's KV into the cache; the draft's slots come first, so committing `b` tokens
keeps exactly the accepted prefix's KV (computed in that same pass) and drops every suffix copy.
The target's next-token logits after each boundary come from the same pass too (draft token b - 1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.errors import ConfigError, InputError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder
from parse_jax.runtime.programs import forward_fn, register_program, to_host
from parse_jax.verify.layout import PackedBlock, pad_blocks

POLICIES = ("earliest_error", "longest_valid")


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


@dataclasses.dataclass
class VerifyOutput:
    scores: np.ndarray        # [B, K] judge score of each prefix (NaN for padded prefixes)
    boundary_logits: jax.Array  # [B, K + 1, V] next-token logits after each boundary; the last entry is at
    #                             `before_index` (e.g. the context's last token, for "nothing accepted")
    cache: KVCache            # block written, lengths unchanged: commit the accepted boundary
    tokens: np.ndarray | None = None     # [B, L] the padded block (with `taps`)
    features: jax.Array | None = None    # [B, L, len(taps) * d] the target's tapped hidden states (EAGLE-3)


@functools.cache
def verify_program(cfg: ModelConfig, attention_impl: str, taps: tuple[int, ...] = ()):
    module = Decoder(cfg, attention_impl)

    def run(params, cache, tokens, positions, limit, group, score_index, boundary_index, yes_id, no_id):
        logits, cache, hiddens = forward_fn(module, params, return_hidden=True)(tokens, positions, cache, limit,
                                                                                 group)
        at_scores = jnp.take_along_axis(logits, score_index[..., None], axis=1)
        scores = scores_from_logits(at_scores, yes_id, no_id)
        boundary_logits = jnp.take_along_axis(logits, boundary_index[..., None], axis=1)
        features = jnp.concatenate([hiddens[i] for i in taps], axis=-1) if taps else None
        return scores, boundary_logits, cache, features

    return register_program(jax.jit(run, donate_argnums=(1,)))


def check_blocks(cache: KVCache, blocks: Sequence[PackedBlock], length: int | None,
                 num_prefixes: int | None) -> tuple[int, int]:
    """The padded block length and prefix count of a verification pass, after checking that each row's block fits
    its cache row and has no more prefixes than that (clear errors instead of silently dropped slots)."""
    if len(blocks) != cache.batch:
        raise InputError(f"{len(blocks)} blocks for a cache of batch {cache.batch}")
    length = length or max(b.length for b in blocks)
    k_max = num_prefixes or max(len(b.score_index) for b in blocks)
    lengths = to_host(cache.lengths)
    for i, blk in enumerate(blocks):
        if lengths[i] + length > cache.max_len:
            raise InputError(f"row {i}: context of {lengths[i]} tokens plus a verification block of {length} "
                             f"does not fit the cache ({cache.max_len} slots)")
        if len(blk.score_index) > k_max:
            raise InputError(f"row {i} has {len(blk.score_index)} prefixes, more than num_prefixes={k_max}")
    return length, k_max


def verify_arrays(blocks: Sequence[PackedBlock], length: int, k_max: int,
                  before_index: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The host inputs of one verification pass: the padded blocks (`pad_blocks`), and per row the block index of
    each prefix's score (`score_index`), of the logits after each boundary (`boundary_index`: draft token b - 1
    predicts the token after a boundary b; copies sit at limit == b; the last column is `before_index`) and
    which prefixes are real (`valid`)."""
    arrays = pad_blocks(blocks, length)
    b = len(blocks)
    arrays["score_index"] = np.zeros((b, k_max), np.int32)
    arrays["boundary_index"] = np.zeros((b, k_max + 1), np.int32)
    if before_index is not None:
        arrays["boundary_index"][: len(before_index), k_max] = np.asarray(before_index, np.int32)
    arrays["valid"] = np.zeros((b, k_max), bool)
    for i, blk in enumerate(blocks):
        k = len(blk.score_index)
        arrays["score_index"][i, :k] = blk.score_index
        arrays["boundary_index"][i, :k] = blk.limit[blk.score_index] - 1
        arrays["valid"][i, :k] = True
    return arrays


def verify_pass(model, cache: KVCache, blocks: Sequence[PackedBlock], yes_id: int, no_id: int,
                length: int | None = None, num_prefixes: int | None = None,
                before_index: Sequence[int] | None = None, taps: Sequence[int] = ()) -> VerifyOutput:
    """One target pass over `cache` + each row's packed block (padded to `length`, K padded to
    `num_prefixes` so shapes stay in buckets). Row i of `blocks` belongs to cache row i.
    `before_index[i]` (block index, default 0) adds the logits of one more block token per row.
    `taps`: also return those hidden states (indices into the decoder's `hiddens`) of every block token."""
    length, k_max = check_blocks(cache, blocks, length, num_prefixes)
    arrays = verify_arrays(blocks, length, k_max, before_index)
    program = verify_program(model.config, model.attention_impl, tuple(int(t) for t in taps))
    scores, boundary_logits, cache, features = program(model.params, cache, arrays["tokens"], arrays["positions"],
                                                       arrays["limit"], arrays["group"], arrays["score_index"],
                                                       arrays["boundary_index"], np.int32(yes_id), np.int32(no_id))
    scores = np.where(arrays["valid"], to_host(scores), np.nan)
    return VerifyOutput(scores=scores, boundary_logits=boundary_logits, cache=cache,
                        tokens=arrays["tokens"] if taps else None, features=features)
