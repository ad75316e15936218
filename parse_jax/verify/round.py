"""The device side of a PARSE round, as functions traced inside the modes' jitted programs: the draft writes its
answer, `segment.py` cuts it, `block.py` packs prompt + draft + one suffix copy per prefix, ONE target pass scores
every prefix, `verify.accept_on_device` picks the accepted one, and the target's cache keeps exactly that prefix.

Nothing here returns to the host: the modes fetch their results (`programs.fetch`), once at the end, or where a
round runs staged also the block length its pass needs (`segmented`, `pick_length`: the host's side of that read).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from parse_jax.models.cache import KVCache
from parse_jax.runtime.decode import decode_loop, is_eos
from parse_jax.runtime.metrics import SCORE_BINS
from parse_jax.runtime.programs import length_bucket
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.settings import Policy, PrefixChoice
from parse_jax.verify.block import pack_block
from parse_jax.verify.scoring import accept_on_device, passes, verify_block
from parse_jax.verify.segment import (
    Segmenter,
    next_step_confidence,
    segment_marks,
    select_boundaries,
    select_by_confidence,
    select_by_value,
)


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    """The static settings of a PARSE round (they shape the program: one compilation per distinct value)."""

    segmenter: Segmenter
    max_prefixes: int     # K, padded to a bucket by the caller
    stride: int
    min_segment: int
    max_segment: int
    policy: Policy
    prefix_choice: PrefixChoice = "spread"  # confidence / auto: chosen per row from the draft's probabilities
    prefix_confidence: float = 1.0

    def draft_sampler(self, sampler: Sampler) -> Sampler:
        """The draft's sampler: keeping its token probabilities where confidence-chosen prefixes read them."""
        return dataclasses.replace(sampler, keep_probs=self.prefix_choice != "spread")


@struct.dataclass
class Judge:
    """The traced inputs every PARSE program takes: the verification suffix, the judge words' ids, the threshold,
    the delimiter automaton and the price of a prefix (prefix_choice "auto": the draft tokens one more suffix copy
    costs at this batch, `schedule.prefix_price`); changing any of them never compiles again."""

    suffix: jax.Array       # int32 [S]
    yes_id: jax.Array       # int32 scalar
    no_id: jax.Array
    threshold: jax.Array    # float32 scalar
    table: jax.Array        # int32 [states, V]: segment.DelimiterTable
    prefix_price: jax.Array = 0.0  # float32 scalar


@struct.dataclass
class Draft:
    """The draft's answer per row, on the device: tokens [B, D] and how many of them count [B]; `probs` [B, D]: the
    draft's probability of each token (kept for confidence-chosen prefixes, else None); `bounds` [B, K] and `count`
    [B]: its prefixes where it was cut before its pass (`segmented`: the pass then scores those, not a recut whose
    floating-point choice could differ in another program), else None."""

    tokens: jax.Array
    length: jax.Array
    probs: jax.Array | None = None
    bounds: jax.Array | None = None
    count: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PassShape:
    """The static shape of a verification pass: the block buckets it may take (`block_lengths`), the target
    layers whose hidden states it returns (EAGLE-3's taps; none by default) and the width its block and features
    come back padded to (0: the longest bucket; a pass set up for one bucket keeps its program's outputs)."""

    lengths: tuple[int, ...]
    taps: tuple[int, ...] = ()
    width: int = 0


def draft_answers(draft_forward, cache: KVCache, first_logits: jax.Array, *, budget: jax.Array, eos_ids: jax.Array,
                  sampler: Sampler, args: SamplingArgs, num_new: int) -> Draft:
    """The draft's whole answer to each prompt (its `cache` holds the prompt, `first_logits` follow it), without a
    closing EOS (the judge was never shown one: the target decides to stop, from its next-token logits at the
    accepted boundary); with `sampler.keep_probs`, each token's probability too (`RoundSpec.draft_sampler`)."""
    state = decode_loop(draft_forward, cache, first_logits, max_new=budget, eos_ids=eos_ids, sampler=sampler,
                        args=args, num_new=num_new)
    n = state.num_new
    last = jnp.take_along_axis(state.tokens, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    n = jnp.where((n > 1) & is_eos(last, eos_ids), n - 1, n)
    return Draft(tokens=state.tokens, length=n, probs=state.probs)


def segment_draft(draft: Draft, table: jax.Array, spec: RoundSpec, *,
                  price: jax.Array | float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(boundaries [B, K], count [B]): where `spec` cuts each row's draft, capped at K spread evenly, or (prefix_choice
    "confidence") the step ends before the steps the draft is least sure of, or ("auto") those whose expected saving
    pays for their suffix copy (`price`: `Judge.prefix_price`)."""
    marks = segment_marks(draft.tokens, draft.length, spec.segmenter, table, spec.stride, spec.min_segment,
                          spec.max_segment)
    if spec.prefix_choice == "auto":
        return select_by_value(marks, draft.probs, draft.length, spec.max_prefixes, cutoff=spec.prefix_confidence,
                               price=price)
    if spec.prefix_choice == "confidence":
        confidence = next_step_confidence(marks, draft.probs, draft.length)
        return select_by_confidence(marks, confidence, draft.length, spec.max_prefixes, spec.prefix_confidence)
    return select_boundaries(marks, spec.max_prefixes)


def join(a: jax.Array, a_len: jax.Array, b: jax.Array, width: int) -> jax.Array:
    """Row-wise a[:a_len] ++ b, [B, width] (padding past the end is b's tail or a's, never read)."""
    i = jnp.arange(width)[None, :]
    from_a = jnp.take_along_axis(a, jnp.minimum(i, a.shape[1] - 1), axis=1)
    from_b = jnp.take_along_axis(b, jnp.clip(i - a_len[:, None], 0, b.shape[1] - 1), axis=1)
    return jnp.where(i < a_len[:, None], from_a, from_b)


@struct.dataclass
class Verified:
    """A verification pass's outcome per row, on the device."""

    cache: KVCache             # context + accepted prefix committed
    first_logits: jax.Array    # [B, V] the target's next-token logits after the accepted prefix
    accepted: jax.Array        # [B] accepted draft tokens (0: none)
    prefixes: jax.Array        # [B] prefixes scored
    block_tokens: jax.Array    # [B] real tokens in the verification block
    tokens: jax.Array          # [B, L] the block (EAGLE-3 continues from its taps)
    features: jax.Array | None
    rejected_at: jax.Array | None = None  # [B, K + 1] one-hot: the first rejected prefix (K: none rejected)
    score_hist: jax.Array | None = None   # [B, 2, SCORE_BINS] judge scores of the accepted / the other prefixes


def block_lengths(longest: int, shortest: int = 8) -> tuple[int, ...]:
    """The padded block lengths a verification pass may take, up to the bucket of the longest possible block: the
    program picks the shortest that holds the real block (`lax.switch`), so a pass costs what its tokens need, not
    what the worst case would (on a CPU a 128-token pass costs about twice a 48-token one)."""
    top = length_bucket(longest)
    out, n = [], length_bucket(shortest)
    while n < top:
        out.append(n)
        n = length_bucket(n + 1)
    return (*out, top)


def block_need(seq_len: jax.Array, count: jax.Array, judge: Judge) -> jax.Array:
    """The longest row's verification block: its head and draft (`seq_len`) and a suffix copy per prefix scored."""
    return jnp.max(seq_len + count * judge.suffix.shape[0])


def segmented(draft: Draft, head_len: jax.Array, judge: Judge, spec: RoundSpec) -> tuple[Draft, jax.Array]:
    """`draft` cut into its prefixes before its pass, and the `block_need` of verifying it after heads of `head_len`
    tokens: what a staged round's host reads to set up only the block length its pass takes (`pick_length`)."""
    bounds, count = segment_draft(draft, judge.table, spec, price=judge.prefix_price)
    return draft.replace(bounds=bounds, count=count), block_need(head_len + draft.length, count, judge)


def pick_length(lengths: tuple[int, ...], needed: int) -> int:
    """The shortest of `lengths` that holds a block of `needed` tokens (the longest where none does), as
    `verify_round` picks its branch on the device."""
    return next((n for n in lengths if n >= needed), lengths[-1])


@functools.cache
def later_block_reach(prompt: int, max_new: int, draft_cap: int, copies: int) -> int:
    """The cache positions a later round's verification block can fill with real tokens for one row (its end,
    exclusive): with `num` tokens written, the block starts at the row's last token (position prompt + num - 1) and
    holds 1 + its draft (at most min(draft_cap, max_new - num) tokens) + its suffix copies, laid out in that order
    (`pack_block`); its padding, up to the padded block length, may fall past the cache and is dropped
    (`models/cache.write_block`). Multi-round programs size their caches so (modes/parse_multi.multi_shape): 128
    positions at a 96-token budget and a 16-token prompt, where one sized for the padded block took 192, and
    every pass (and the draft's every step) paid attention over the 64 more."""
    return max((prompt + num + min(draft_cap, max_new - num) + copies for num in range(1, max_new)), default=0)


def verify_round(target_forward, cache: KVCache, judge: Judge, *, head: jax.Array, head_len: jax.Array,
                 draft: Draft, spec: RoundSpec, shape: PassShape) -> Verified:
    """Score every prefix of `head[:head_len] ++ draft`'s draft part in ONE pass over `cache` (its rows' committed
    tokens are the context), accept, and commit `head` + the accepted prefix. `head`: the tokens before the draft
    that the target has not seen yet (the whole prompt over an empty cache, or the target's last emitted token).
    The block is padded to the shortest of `shape.lengths` that holds every row's block."""
    ctx_len, lengths, taps = cache.lengths, shape.lengths, shape.taps
    if draft.count is None:
        bounds, count = segment_draft(draft, judge.table, spec, price=judge.prefix_price)
    else:  # cut before the pass (`segmented`)
        bounds, count = draft.bounds, draft.count
    draft, draft_len = draft.tokens, draft.length
    b = draft.shape[0]
    seq = join(head, head_len, draft, head.shape[1] + draft.shape[1])
    valid = jnp.arange(spec.max_prefixes)[None, :] < count[:, None]
    seq_bounds = jnp.where(valid, head_len[:, None] + bounds, 0)
    seq_len = head_len + draft_len
    longest = max(lengths[-1], shape.width)

    def pass_of(length: int):
        def run(cache):
            block = pack_block(ctx_len, seq, seq_len, seq_bounds, count, judge.suffix, length, before=head_len - 1)
            scores, boundary_logits, cache, features = verify_block(target_forward, cache, block, judge.yes_id,
                                                                   judge.no_id, taps)
            pad = longest - length
            tokens = jnp.pad(block.tokens, ((0, 0), (0, pad)))
            if features is not None:
                features = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
            return scores, boundary_logits, cache, tokens, features, block.valid, block.num_tokens
        return run

    needed = block_need(seq_len, count, judge)
    branch = jnp.minimum(jnp.sum(jnp.asarray(lengths) < needed), len(lengths) - 1)
    scores, boundary_logits, cache, tokens, features, valid, num_tokens = jax.lax.switch(
        branch, [pass_of(n) for n in lengths], cache)
    idx = accept_on_device(jnp.nan_to_num(scores), valid, judge.threshold, spec.policy)
    accepted = jnp.where(idx >= 0, jnp.take_along_axis(bounds, jnp.maximum(idx, 0)[:, None], axis=1)[:, 0], 0)
    take = jnp.where(idx >= 0, idx, spec.max_prefixes)  # the last column: the head's last token
    rows = jnp.arange(b)
    rejected_at, score_hist = step_counts(scores, valid, idx, judge.threshold)
    return Verified(cache=cache.set_lengths(ctx_len + head_len + accepted), first_logits=boundary_logits[rows, take],
                    accepted=accepted, prefixes=count, block_tokens=num_tokens, tokens=tokens, features=features,
                    rejected_at=rejected_at, score_hist=score_hist)


def step_counts(scores: jax.Array, valid: jax.Array, idx: jax.Array, threshold: jax.Array):
    """PARSE's per-step figures of one pass (parse_jax/runtime/metrics.py): ([B, K + 1] one-hot of the first
    prefix whose judge score is below the threshold, K where none is; [B, 2, SCORE_BINS] counts of the judge scores
    of the accepted prefixes (those up to the kept one, `idx`) and of the other prefixes scored)."""
    k = scores.shape[-1]
    fail = ~passes(jnp.nan_to_num(scores), threshold) & valid
    first = jnp.where(fail.any(-1), jnp.argmax(fail, -1), k)
    rejected_at = jax.nn.one_hot(first, k + 1, dtype=jnp.int32)
    bins = jnp.clip((jnp.nan_to_num(scores) * SCORE_BINS).astype(jnp.int32), 0, SCORE_BINS - 1)
    kept = (jnp.arange(k)[None] <= idx[:, None]) & valid
    onehot = jax.nn.one_hot(bins, SCORE_BINS, dtype=jnp.int32)  # [B, K, bins]
    hist = jnp.stack([jnp.sum(onehot * kept[..., None], 1), jnp.sum(onehot * (valid & ~kept)[..., None], 1)], 1)
    return rejected_at, hist


def ends_in_eos(draft: jax.Array, accepted: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """The accepted prefix closes with an EOS: the request is finished."""
    last = jnp.take_along_axis(draft, jnp.maximum(accepted - 1, 0)[:, None], axis=1)[:, 0]
    return (accepted > 0) & is_eos(last, eos_ids)
