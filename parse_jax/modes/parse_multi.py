"""Multi-round PARSE (modes parse and parse+eagle3, `rounds="multi"`): rounds of (the draft drafts -> ONE target
pass verifies every step-prefix -> the longest valid one is kept -> the target writes up to its next step end) in
one `lax.while_loop`, neither cache prefilled again. The target writes its step token by token (parse) or with
EAGLE-3 chains (parse+eagle3), the head reading the taps of that round's verification pass; the head's cache, like
the target's, carries from round to round. A step ends where the delimiter automaton ends an occurrence, its state
carried from token to token over the whole output (`verify/step.py`).

Two ways to run a request:
- `run_multi`: one program for the whole batch (the first round verifies prompt + draft over an empty cache, the
  loop runs until every row is done);
- `serve_multi`: continuous batching over any number of prompts through `max_batch` slots. A prompt's first round
  runs when it is admitted (the same first round, on the admitted rows only), its row of both caches is moved into
  a free slot, and the loop runs the later rounds of every slot until enough slots are free for the next admission.
  A row's rounds read only its own cache rows, so greedy outputs equal those of the prompt alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from parse_jax.models.cache import KVCache
from parse_jax.models.decoder import Decoder, causal_metadata
from parse_jax.modes.context import Launch, ModeContext, PairSpec, parse_result
from parse_jax.runtime.decode import decode_loop, is_eos, prefill
from parse_jax.runtime.metrics import SCORE_BINS
from parse_jax.runtime.programs import bucket, committed, fetch, forward_fn, length_bucket, register_program
from parse_jax.runtime.requests import PAD_ID, GenerateResult, Prompts, Request, device_prompts, pad_prompts
from parse_jax.runtime.sampling import Sampler, SamplingArgs, unread_keys
from parse_jax.runtime.slots import SlotBook, admission_keys, request_budgets, warm_admissions
from parse_jax.speculation.eagle3 import (
    Eagle3Config,
    EagleContext,
    EagleLoop,
    eagle_loop,
    first_token,
    head_applies,
    slots_needed,
)
from parse_jax.verify.round import (
    Draft,
    Judge,
    PassShape,
    RoundSpec,
    Verified,
    block_lengths,
    ends_in_eos,
    later_block_reach,
    verify_round,
)
from parse_jax.verify.segment import state_after
from parse_jax.verify.step import StepStop, cut_at_step_end, step_loop


@dataclasses.dataclass(frozen=True)
class EagleSpec:
    """The static settings of an EAGLE-3 continuation (mode parse+eagle3)."""

    config: Eagle3Config
    gamma: int
    tree: int
    tree_top_k: int = 4
    tree_width: int = 0

    @property
    def margin(self) -> int:
        """Positions an EAGLE-3 round writes past the last token it may emit (`EagleLoop.slots`: the chain or the
        tree's block, and its head steps)."""
        return slots_needed(self.gamma, self.tree, self.tree_top_k, self.tree_width)

    @property
    def loop_slots(self) -> int:
        return self.margin


@dataclasses.dataclass(frozen=True)
class MultiShape:
    """Static shapes of a multi-round program."""

    prompt: int        # prompt bucket
    draft_cap: int     # the most draft tokens per round (max_draft_tokens)
    draft_new: int     # its bucket
    segment_cap: int   # the most tokens the target writes per round (max_segment)
    pending: int       # tokens the draft may have to catch up on per round (the target's segment + 1)
    first_lengths: tuple[int, ...]  # the first round's block buckets: prompt + draft + K suffix copies
    lengths: tuple[int, ...]        # later rounds': the target's last token + draft + K suffix copies
    segment: int       # bucket of segment_cap
    num_new: int       # the output buffer (bucket of max_new_tokens)
    cache_len: int     # both caches (and the EAGLE-3 head's)
    first_draft_cache: int  # the draft's cache in the first round (prompt + one draft, as single round's), grown
                            # to `cache_len` after it


@struct.dataclass
class MultiState:
    target_cache: KVCache    # prompt + output except `last`
    draft_cache: KVCache     # the first `draft_cache.lengths` tokens of prompt + output
    seq: jax.Array           # [B, P + N + D] prompt then output: what the draft catches up from
    out: jax.Array           # [B, N + D] the output so far
    prompt_len: jax.Array    # [B]
    max_new: jax.Array       # [B] the row's budget (0: an empty row)
    num_new: jax.Array       # [B] output tokens
    last: jax.Array          # [B] the last token of prompt + output (the target has not seen it yet)
    done: jax.Array          # [B]
    rounds: jax.Array        # scalar: loop rounds (each one verification pass of the batch)
    passes: jax.Array        # scalar: target passes
    accepted: jax.Array      # [B] draft tokens accepted over all rounds
    drafted: jax.Array       # [B] draft tokens written
    block_tokens: jax.Array  # [B] verification tokens
    prefixes: jax.Array      # [B] prefixes scored
    rejected_at: jax.Array   # [B, K + 1] passes by their first rejected prefix (K: none) (runtime/metrics.py)
    score_hist: jax.Array    # [B, 2, SCORE_BINS] judge scores of accepted / other prefixes
    delim: jax.Array         # [B] the delimiter automaton's state after the output so far
    eagle_accepted: jax.Array  # [B] EAGLE-3 proposals accepted (parse+eagle3; 0 otherwise)
    eagle_proposed: jax.Array  # [B] EAGLE-3 proposals verified
    keys: jax.Array          # [B, 2] each row's key: a round draws with `fold_in(key, num_new)`, the row's own count
    head_cache: KVCache | None = None  # parse+eagle3: the head's entries, as many per row as the target's cache


ROW_FIELDS = ("accepted", "drafted", "block_tokens", "prefixes", "rejected_at", "score_hist")  # per-row counters
EAGLE_FIELDS = {"eagle_accepted": "eagle3_accepted_tokens", "eagle_proposed": "eagle3_draft_tokens"}


def write_at(buf: jax.Array, start: jax.Array, values: jax.Array, count: jax.Array) -> jax.Array:
    """buf[b, start[b] + j] = values[b, j] for j < count[b] (other slots unchanged)."""
    b, w = values.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
    j = jnp.arange(w)[None, :]
    cols = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])
    return buf.at[rows, cols].set(values, mode="drop")


@dataclasses.dataclass(frozen=True)
class RoundInputs:
    """A program's traced inputs to every round: the weights ((target, draft, EAGLE-3 head or None)), the stop ids
    (EOS; EOS and the single-token step ends, where an EAGLE-3 step stops by itself) and the judge (its delimiter
    automaton ends the target's steps)."""

    weights: tuple
    eos_ids: jax.Array
    seg_stop: jax.Array
    judge: Judge

    @property
    def target_params(self):
        return self.weights[0]

    @property
    def draft_params(self):
        return self.weights[1]


@struct.dataclass
class Step:
    """What the target wrote in a round's step: tokens [B, segment], how many count, both caches after them (all but
    the last token), the automaton's state after them, its target passes and the EAGLE-3 counters."""

    tokens: jax.Array
    count: jax.Array
    target_cache: KVCache
    head_cache: KVCache | None
    state: jax.Array
    passes: jax.Array
    eagle_accepted: jax.Array
    eagle_proposed: jax.Array


@functools.cache
def _rounds(pair: PairSpec, spec: RoundSpec, shape: MultiShape, sampler: Sampler, eagle: EagleSpec | None = None):
    """(first_round, later_round): the two kinds of round, traced inside the programs below."""
    target, draft = Decoder(pair.target, pair.target_impl), Decoder(pair.draft, pair.draft_impl)
    d, w, p = shape.draft_new, shape.pending, shape.prompt
    taps = eagle.config.taps if eagle is not None else ()

    def plain_step(x: RoundInputs, s: MultiState, v: Verified, cache: KVCache, remaining, stop: StepStop,
                   args: SamplingArgs) -> Step:
        """The target writes its step token by token, stopping at the step end."""
        st = step_loop(forward_fn(target, x.target_params), cache, v.first_logits, max_new=remaining, stop=stop,
                       sampler=sampler, args=args, num_new=shape.segment)
        zeros = jnp.zeros_like(st.num_new)
        return Step(st.tokens, st.num_new, st.cache, None, st.state, jnp.maximum(st.step - 1, 0), zeros, zeros)

    def eagle_step(x: RoundInputs, s: MultiState, v: Verified, cache: KVCache, remaining, stop: StepStop,
                   args: SamplingArgs) -> Step:
        """The target writes its step with EAGLE-3 from the taps of the verification pass, the head continuing its
        own cache; the chains stop by themselves at EOS and single-token step ends, and are cut at the first step
        end the automaton sees (a delimiter written over two tokens). Where every row's step is one last token (EOS,
        or its budget's last: an answer accepted whole), no head pass runs (`eagle_start`)."""
        fns = head_applies(pair.target, eagle.config, pair.target_impl, x.target_params, x.weights[2])
        first = first_token(v.first_logits, sampler, args)  # what the loop emits first
        finishes = finishing_rows(remaining, s.max_new - s.num_new - v.accepted, first, x.eos_ids)
        ctx = EagleContext(tokens=v.tokens, features=v.features, length=cache.lengths - s.head_cache.lengths,
                           first_logits=v.first_logits, head_cache=s.head_cache, finishes=finishes)
        es = eagle_loop(fns, cache, ctx, loop=EagleLoop.of(eagle.config, eagle, num_new=shape.segment),
                        max_new=remaining, eos_ids=x.seg_stop, sampler=sampler, args=args)
        tokens = es.tokens[:, :shape.segment]
        count, state = cut_at_step_end(tokens, es.num_new, stop.table, stop.state)
        # both caches hold the step's tokens but its last (a chain commits past an EOS or a cut: rolled back)
        lengths = jnp.where(count > 0, cache.lengths + count - 1, cache.lengths)
        return Step(tokens, count, es.target_cache.set_lengths(lengths), es.head_cache.set_lengths(lengths), state,
                    es.rounds, es.accepted, es.proposed)

    write_step = plain_step if eagle is None else eagle_step

    def round_(x: RoundInputs, s: MultiState, args: SamplingArgs, prompt: jax.Array | None, draft_cache: KVCache,
               draft_first: jax.Array) -> MultiState:
        """One round; `prompt` given: the first (prompt + draft in one pass over the empty cache)."""
        t_fwd = forward_fn(target, x.target_params, return_hidden=True)
        d_fwd = forward_fn(draft, x.draft_params)
        b = s.done.shape[0]
        rows = jnp.arange(b)
        a_draft, a_cont = args.with_keys(s.keys).fold(s.num_new).split(2)  # the row's own round
        live = ~s.done
        seq_len = s.prompt_len + s.num_new
        budget = jnp.where(live, jnp.minimum(shape.draft_cap, s.max_new - s.num_new), 0)
        dstate = decode_loop(d_fwd, draft_cache, draft_first, max_new=budget, eos_ids=x.eos_ids,
                             sampler=spec.draft_sampler(sampler), args=a_draft, num_new=d)
        draft_tokens, n = dstate.tokens, dstate.num_new
        closing = jnp.take_along_axis(draft_tokens, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
        # a closing EOS is not verified (the judge never saw one): the target's next token decides to stop
        draft_len = jnp.maximum(jnp.where((n > 1) & is_eos(closing, x.eos_ids), n - 1, n), 1)
        answer = Draft(tokens=draft_tokens, length=draft_len, probs=dstate.probs)
        if prompt is not None:  # the prompt and the draft in one pass over the empty cache
            v = verify_round(t_fwd, s.target_cache, x.judge, head=prompt, head_len=s.prompt_len, draft=answer,
                             spec=spec, shape=PassShape(shape.first_lengths, taps))
        else:  # the target's last token and the draft over its cache
            v = verify_round(t_fwd, s.target_cache, x.judge, head=s.last[:, None], head_len=jnp.ones((b,), jnp.int32),
                             draft=answer, spec=spec, shape=PassShape(shape.lengths, taps))
        acc = jnp.where(live, v.accepted, 0)
        out = write_at(s.out, s.num_new, draft_tokens, acc)
        seq_ = write_at(s.seq, seq_len, draft_tokens, acc)
        num = s.num_new + acc
        done = s.done | (live & (ends_in_eos(draft_tokens, acc, x.eos_ids) | (num >= s.max_new)))
        # the target writes up to its next step end (or EOS, or the budget), the automaton's state carried from the
        # output before it through the accepted prefix
        remaining = jnp.where(done, 0, jnp.minimum(shape.segment_cap, s.max_new - num))
        cache = v.cache.set_lengths(jnp.where(live, v.cache.lengths, s.target_cache.lengths))
        stop = StepStop(x.eos_ids, x.judge.table, state_after(draft_tokens, acc, x.judge.table, s.delim))
        st = write_step(x, s, v, cache, remaining, stop, a_cont)
        wrote = st.count
        out = write_at(out, num, st.tokens, wrote)
        seq_ = write_at(seq_, seq_len + acc, st.tokens, wrote)
        num2 = num + wrote
        seg_last = st.tokens[rows, jnp.maximum(wrote - 1, 0)]
        done = done | ((wrote > 0) & (is_eos(seg_last, x.eos_ids) | (num2 >= s.max_new)))
        # the draft keeps what it read of the accepted prefix (all but its last token were fed back to it)
        d_keep = draft_cache.lengths + jnp.minimum(acc, jnp.maximum(n - 1, 0))
        d_cache = dstate.cache.set_lengths(jnp.where(live, d_keep, draft_cache.lengths))
        return s.replace(
            target_cache=st.target_cache, draft_cache=d_cache, head_cache=st.head_cache, seq=seq_, out=out,
            num_new=num2, last=jnp.where(wrote > 0, seg_last, s.last), done=done, rounds=s.rounds + 1,
            passes=s.passes + 1 + st.passes, delim=jnp.where(live, st.state, s.delim),
            eagle_accepted=s.eagle_accepted + jnp.where(live, st.eagle_accepted, 0),
            eagle_proposed=s.eagle_proposed + jnp.where(live, st.eagle_proposed, 0),
            accepted=s.accepted + acc, drafted=s.drafted + jnp.where(live, draft_len, 0),
            block_tokens=s.block_tokens + jnp.where(live, v.block_tokens, 0),
            prefixes=s.prefixes + jnp.where(live, v.prefixes, 0),
            rejected_at=s.rejected_at + jnp.where(live[:, None], v.rejected_at, 0),
            score_hist=s.score_hist + jnp.where(live[:, None, None], v.score_hist, 0))

    def first_round(x: RoundInputs, prompts: Prompts, args: SamplingArgs) -> MultiState:
        """A fresh state for `prompts` after their first round."""
        prompt, prompt_lens = prompts.tokens, prompts.lens
        b = prompt.shape[0]
        d_cache, d_first = prefill(forward_fn(draft, x.draft_params), pair.draft, prompt, prompt_lens,
                                   shape.first_draft_cache)
        zeros = jnp.zeros((b,), jnp.int32)
        state = MultiState(target_cache=KVCache.init(pair.target, b, shape.cache_len), draft_cache=d_cache,
                           seq=jnp.zeros((b, p + shape.num_new + d), jnp.int32).at[:, :p].set(prompt),
                           out=jnp.full((b, shape.num_new + d), PAD_ID, jnp.int32), prompt_len=prompt_lens,
                           max_new=prompts.max_new, num_new=zeros, last=prompt[jnp.arange(b), prompt_lens - 1],
                           done=prompts.max_new <= 0, rounds=jnp.int32(0), passes=jnp.int32(0), accepted=zeros,
                           drafted=zeros, block_tokens=zeros, prefixes=zeros, **step_counters(spec, b),
                           delim=zeros, eagle_accepted=zeros, eagle_proposed=zeros, keys=args.key,
                           head_cache=fresh_head(eagle, b, shape.cache_len))
        s = round_(x, state, args, prompt, d_cache, d_first)
        return s.replace(draft_cache=s.draft_cache.padded(shape.cache_len))

    def later_round(x: RoundInputs, s: MultiState, args: SamplingArgs) -> MultiState:
        """The draft reads what it has not seen (the target's last segment), then a round over both caches."""
        b = s.done.shape[0]
        start = s.draft_cache.lengths
        n_pend = s.prompt_len + s.num_new - start
        idx = jnp.clip(start[:, None] + jnp.arange(w)[None, :], 0, s.seq.shape[1] - 1)
        limit, group = causal_metadata(b, w)
        pos = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
        d_fwd = forward_fn(draft, x.draft_params)
        logits, dc = d_fwd(jnp.take_along_axis(s.seq, idx, axis=1), pos, s.draft_cache, limit, group)
        return round_(x, s, args, None, dc.commit(n_pend), logits[jnp.arange(b), jnp.maximum(n_pend - 1, 0)])

    return first_round, later_round


def finishing_rows(remaining: jax.Array, left: jax.Array, first: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """[B] the rows whose answer ends if their step ends at its `first` token: no step left to write, the budget's
    last token (`left` tokens of budget), or EOS. A step end that is not EOS (a delimiter) ends only the step: the
    next round's EAGLE-3 reads the head's cache on, so the head's pass over the block must run."""
    return (remaining <= 0) | (left <= 1) | is_eos(first, eos_ids)


def fresh_head(eagle: EagleSpec | None, b: int, cache_len: int) -> KVCache | None:
    """An empty EAGLE-3 head cache of `b` rows (None without EAGLE-3)."""
    return None if eagle is None else KVCache.init(eagle.config.layer, b, cache_len)


def step_counters(spec: RoundSpec, b: int) -> dict:
    """Zeroed per-step counters of `b` rows (runtime/metrics.py)."""
    return {"rejected_at": jnp.zeros((b, spec.max_prefixes + 1), jnp.int32),
            "score_hist": jnp.zeros((b, 2, SCORE_BINS), jnp.int32)}


def _result(s: MultiState, eagle: bool) -> dict:
    out = {"tokens": s.out, "num_new": s.num_new, "rounds": s.rounds, "target_passes": s.passes,
           "accepted": s.accepted, "draft_len": s.drafted, "block_tokens": s.block_tokens, "prefixes": s.prefixes,
           "rejected_at": s.rejected_at, "score_hist": s.score_hist}
    if eagle:
        out.update({key: getattr(s, f) for f, key in EAGLE_FIELDS.items()})
    return out


@functools.cache
def multi_round_program(pair: PairSpec, spec: RoundSpec, shape: MultiShape, sampler: Sampler,
                        eagle: EagleSpec | None = None):
    """The whole generation of a batch: its first round, then later rounds until every row is done. `weights`:
    (target, draft, EAGLE-3 head or None) parameters."""
    first_round, later_round = _rounds(pair, spec, shape, sampler, eagle)

    def run(weights, prompts: Prompts, eos_ids, seg_stop, judge: Judge, args: SamplingArgs):
        x = RoundInputs(weights, eos_ids, seg_stop, judge)
        state = first_round(x, prompts, args)
        s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: later_round(x, s, args), state)
        return _result(s, eagle is not None)

    return register_program(jax.jit(run))


def multi_shape(ctx: ModeContext, prompt_bucket: int, max_new: int, eagle: EagleSpec | None = None) -> MultiShape:
    """The static shapes of multi-round programs for prompts up to `prompt_bucket` tokens and a budget of `max_new`
    (`eagle`: the target's steps written with EAGLE-3, whose rounds write past their last token)."""
    cfg, p = ctx.config, prompt_bucket
    cap, seg_cap = cfg.max_draft_tokens, cfg.max_segment  # static; each row is cut to its budget
    d = bucket(min(cap, max_new), 16)
    seg = min(seg_cap, max_new)
    copies = ctx.round_spec.max_prefixes * len(ctx.suffix_ids)
    first_lengths, lengths = block_lengths(p + d + copies), block_lengths(1 + d + copies)
    written = p + max_new + (eagle.margin if eagle is not None else 1)  # the output, and what a step writes past it
    # Only real tokens must fit: a write's padding past the end is dropped (`models/cache.write_block`, mode="drop"),
    # and a row's padding can fall there (its block padded for another row's draft or to the next length, the
    # draft's catch-up of `pending` slots, the EAGLE-3 head's pass over the block padded to `lengths[-1]`); a
    # clamping write would need those added here
    reach = later_block_reach(p, max_new, min(cap, d), copies)
    return MultiShape(prompt=p, draft_cap=cap, draft_new=d, segment_cap=seg_cap, pending=bucket(seg + 2, 8),
                      first_lengths=first_lengths, lengths=lengths, segment=bucket(seg, 16),
                      num_new=bucket(max_new, 16),
                      cache_len=length_bucket(max(first_lengths[-1], written, reach)),
                      first_draft_cache=length_bucket(p + d))


def _seg_stop(ctx: ModeContext, req: Request) -> np.ndarray:
    return np.array(sorted({*req.eos.tolist(), *ctx.step_end_ids.tolist()}), np.int32)


def eagle_spec(ctx: ModeContext) -> EagleSpec:
    """The EAGLE-3 continuation's settings of this engine (mode parse+eagle3)."""
    e = ctx.config.eagle3
    return EagleSpec(ctx.head.config, e.gamma, e.tree, e.tree_top_k, e.tree_width)


def _weights(ctx: ModeContext, eagle: bool) -> tuple:
    return ctx.target.params, ctx.draft.params, ctx.head.params if eagle else None


def multi_launch(ctx: ModeContext, req: Request, eagle: bool = False) -> Launch:
    """The multi-round program for `req` (`eagle`: mode parse+eagle3)."""
    ids, target = req.ids, ctx.target
    b, p = bucket(len(ids), 1), bucket(max(len(x) for x in ids))
    es = eagle_spec(ctx) if eagle else None
    shape = multi_shape(ctx, p, req.max_new, es)
    program = multi_round_program(PairSpec.of(ctx), ctx.round_spec, shape, req.sampling.sampler, es)
    return Launch(program, (_weights(ctx, eagle), device_prompts(target, ids, b, p, req.budget_list()), req.eos,
                            _seg_stop(ctx, req), ctx.judge, req.sampling.args(b)))


def run_multi(ctx: ModeContext, req: Request, eagle: bool = False) -> GenerateResult:
    """Multi-round PARSE (modes parse and parse+eagle3 with `eagle`, rounds multi): one program for the whole
    generation."""
    launch = multi_launch(ctx, req, eagle)
    t0 = time.perf_counter()
    res = fetch(launch.program(*launch.args))
    seconds = time.perf_counter() - t0
    return parse_result(ctx, req, res, seconds, verify_passes=int(res["rounds"]),
                        target_passes=int(res["target_passes"]), rounds=int(res["rounds"]))


# ------------------------------------------------------------------------------------------ continuous batching


def _put(big, small, slots):
    """Rows `slots` of `big` (a state or cache of the slot batch) set from the rows of `small` (dropped past B)."""
    return jax.tree.map(lambda a, x: a.at[slots].set(x, mode="drop"), big, small)


@struct.dataclass
class Admission:
    """Up to k prompts (k bucketed) for the free slots named in `slots` (unused entries name slot B: dropped)."""

    slots: jax.Array   # [k]
    prompts: Prompts   # [k, P], with each one's budget
    keys: jax.Array    # [k, 2] each prompt's key


@functools.cache
def _slot_programs(pair: PairSpec, spec: RoundSpec, shape: MultiShape, sampler: Sampler,
                   eagle: EagleSpec | None = None):
    """(admit, advance) for one run's shapes, the slot state donated to both:
    - `admit`: the first round of up to k prompts (k bucketed), their rows moved into the slots the host names;
    - `advance`: later rounds of every slot until `free_target` slots are done (or all are)."""
    first_round, later_round = _rounds(pair, spec, shape, sampler, eagle)

    def admit(weights, state: MultiState, adm: Admission, eos_ids, seg_stop, judge: Judge,
              args: SamplingArgs) -> MultiState:
        x = RoundInputs(weights, eos_ids, seg_stop, judge)
        new = first_round(x, adm.prompts, args.with_keys(adm.keys))
        real = jnp.any(adm.slots < state.done.shape[0])  # an empty admission (a warm-up) counts no passes
        return _put_rows(state, new, adm.slots).replace(passes=state.passes + jnp.where(real, new.passes, 0))

    def advance(weights, state: MultiState, free_target, eos_ids, seg_stop, judge: Judge,
                args: SamplingArgs) -> MultiState:
        x = RoundInputs(weights, eos_ids, seg_stop, judge)
        cond = lambda s: ~jnp.all(s.done) & (jnp.sum(s.done) < free_target)  # noqa: E731
        return jax.lax.while_loop(cond, lambda s: later_round(x, s, args), state)

    return (register_program(jax.jit(admit, donate_argnums=(1,))),
            register_program(jax.jit(advance, donate_argnums=(1,))))


def _put_rows(state: MultiState, new: MultiState, slots) -> MultiState:
    """`state` with the rows of `new` in `slots` (every per-row field; the scalars of `state` kept)."""
    scalars = {"rounds": state.rounds, "passes": state.passes}
    rows = {f.name: _put(getattr(state, f.name), getattr(new, f.name), slots)
            for f in dataclasses.fields(MultiState) if f.name not in scalars}
    return MultiState(**rows, **scalars)


def empty_slots(pair: PairSpec, spec: RoundSpec, shape: MultiShape, slots: int,
                eagle: EagleSpec | None = None) -> MultiState:
    """A slot state whose every row is empty (done, no budget); every field its own buffer (the state is donated)."""
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731
    return MultiState(target_cache=KVCache.init(pair.target, slots, shape.cache_len),
                      draft_cache=KVCache.init(pair.draft, slots, shape.cache_len),
                      seq=jnp.zeros((slots, shape.prompt + shape.num_new + shape.draft_new), jnp.int32),
                      out=jnp.full((slots, shape.num_new + shape.draft_new), PAD_ID, jnp.int32),
                      prompt_len=jnp.ones((slots,), jnp.int32), max_new=zeros(), num_new=zeros(), last=zeros(),
                      done=jnp.ones((slots,), bool), rounds=jnp.int32(0), passes=jnp.int32(1) - 1, accepted=zeros(),
                      drafted=zeros(), block_tokens=zeros(), prefixes=zeros(), **step_counters(spec, slots),
                      delim=zeros(), eagle_accepted=zeros(), eagle_proposed=zeros(),
                      keys=jnp.asarray(unread_keys(slots)),
                      head_cache=fresh_head(eagle, slots, shape.cache_len))


def serve_multi(ctx: ModeContext, req: Request, max_batch: int, *, budgets: list[int] | None = None,
                eagle: bool = False) -> GenerateResult:
    """Multi-round PARSE over every prompt of `req` with at most `max_batch` in flight: a finished row's slot takes
    the next prompt (its first round at admission), with no program compiled per prompt. Results in prompt order.
    `budgets`: each prompt's own max_new_tokens (default: the request's); `eagle`: mode parse+eagle3."""
    ids = req.ids
    budgets = request_budgets(req, budgets)
    pair = PairSpec.of(ctx)
    capacity = min(max_batch, len(ids))
    slots = bucket(capacity, 1)
    p = bucket(max(len(x) for x in ids))
    es = eagle_spec(ctx) if eagle else None
    shape = multi_shape(ctx, p, max(budgets), es)
    admit, advance = _slot_programs(pair, ctx.round_spec, shape, req.sampling.sampler, es)
    weights = _weights(ctx, eagle)
    fields = (*ROW_FIELDS, *(EAGLE_FIELDS if eagle else ()))
    args, keys = req.sampling.args(1), req.sampling.keys(len(ids))
    seg_stop = _seg_stop(ctx, req)
    state = committed(empty_slots(pair, ctx.round_spec, shape, slots, es), weights)
    book = SlotBook(len(ids), slots, capacity)
    rows: dict[str, list] = {k: [None] * len(ids) for k in ("tokens", *fields)}
    admissions = 0

    def admit_at(state: MultiState, batch: list[int], where: np.ndarray, i: int) -> MultiState:
        prompt, lens, max_new = pad_prompts([ids[r] for r in batch], len(where), p, 0)
        max_new[:len(batch)] = [budgets[r] for r in batch]
        adm = Admission(slots=where, prompts=Prompts(tokens=prompt, lens=lens, max_new=max_new),
                        keys=admission_keys(keys, batch, len(where)))
        return admit(weights, state, adm, req.eos, seg_stop, ctx.judge, args)

    t0 = time.perf_counter()
    state = warm_admissions(admit_at, state, slots=slots, key=(admit, p))
    while True:
        admitted = book.admit()
        if admitted is not None:
            state = admit_at(state, *admitted, admissions)
            admissions += 1
        state = advance(weights, state, book.free_target(), req.eos, seg_stop, ctx.judge, args)
        got = fetch({"done": state.done, "num_new": state.num_new, "out": state.out, "rounds": state.rounds,
                     "passes": state.passes, **{k: getattr(state, k) for k in fields}})
        for s, r in book.finish(got["done"]):
            rows["tokens"][r] = got["out"][s, : got["num_new"][s]].tolist()
            for key in fields:
                rows[key][r] = got[key][s]
        if book.empty:
            break
    seconds = time.perf_counter() - t0
    lengths = [len(t) for t in rows["tokens"]]
    width = max(max(lengths), 1)
    out = {"tokens": np.array([t + [PAD_ID] * (width - len(t)) for t in rows["tokens"]], np.int32),
           "num_new": np.array(lengths, np.int32), "accepted": np.array(rows["accepted"]),
           "draft_len": np.array(rows["drafted"]), "block_tokens": np.array(rows["block_tokens"]),
           "prefixes": np.array(rows["prefixes"]), "rejected_at": np.stack(rows["rejected_at"]),
           "score_hist": np.stack(rows["score_hist"]),
           **{EAGLE_FIELDS[f]: np.array(rows[f]) for f in fields if f in EAGLE_FIELDS}}
    verify_passes = int(got["rounds"]) + admissions
    res = parse_result(ctx, req, out, seconds, verify_passes=verify_passes, target_passes=int(got["passes"]),
                       rounds=verify_passes)
    # a pass carries every slot: per request, at most `capacity` rows' worth (rows are not tracked per pass)
    res.stats.update(slots=capacity, admissions=admissions, request_passes=int(got["passes"]) * capacity)
    return res
