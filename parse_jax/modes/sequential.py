"""Mode `sequential` (SpecReason-style step verification): the same draft and segments as PARSE, but one target
pass per segment (the segment + the suffix, over the cache that holds the prompt and the segments before it).
By design it costs one pass per segment; it runs as one program, with no host round trip between segments.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from flax import struct

from parse_jax.models.cache import KVCache
from parse_jax.models.decoder import Decoder
from parse_jax.modes.context import ModeContext, PairSpec, parse_result
from parse_jax.modes.parse import ContinueSpec, boundary_stop, continuation
from parse_jax.modes.verified_slots import serve_verified
from parse_jax.runtime.decode import prefill
from parse_jax.runtime.programs import bucket, fetch, forward_fn, length_bucket, register_program
from parse_jax.runtime.requests import GenerateResult, Prompts, Request, device_prompts
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.speculation.eagle3 import EagleContext
from parse_jax.verify.block import pack_block
from parse_jax.verify.round import Judge, RoundSpec, block_lengths, draft_answers, ends_in_eos, join, segment_draft
from parse_jax.verify.scoring import passes, verify_block


@dataclasses.dataclass(frozen=True)
class SequentialShape:
    draft_cap: int
    draft_new: int
    draft_cache: int
    lengths: tuple[int, ...]   # segment + suffix block buckets
    cache_len: int
    num_new: int


@struct.dataclass
class SegmentState:
    cache: KVCache
    first_logits: jax.Array   # [B, V] after the last accepted segment (or the prompt)
    accepted: jax.Array       # [B] draft tokens accepted
    stopped: jax.Array        # [B] earliest_error: a segment failed
    k: jax.Array              # scalar: the segment being verified
    passes: jax.Array         # scalar
    block_tokens: jax.Array   # [B]


@functools.cache
def sequential_verify(pair: PairSpec, spec: RoundSpec, shape: SequentialShape, sampler: Sampler):
    """The traced verification of mode `sequential`: `(target_params, draft_params, prompts, eos_ids, judge, args)
    -> dict` of the draft, the accepted prefix committed in the target's cache (`cache`, `first_logits` after it),
    `live` (rows with tokens left to write), `stop` (those of them whose next token is EOS: written with no pass),
    the per-row counters and `verify_passes`."""
    target, draft = Decoder(pair.target, pair.target_impl), Decoder(pair.draft, pair.draft_impl)
    target_cfg = pair.target

    def verify(target_params, draft_params, prompts: Prompts, eos_ids, judge: Judge, args: SamplingArgs) -> dict:
        prompt, prompt_lens, max_new = prompts.tokens, prompts.lens, prompts.max_new
        b = prompt.shape[0]
        rows = jnp.arange(b)
        budget = jnp.where(max_new > 0, jnp.minimum(shape.draft_cap, max_new), 0)
        d_fwd = forward_fn(draft, draft_params)
        d_cache, d_first = prefill(d_fwd, pair.draft, prompt, prompt_lens, shape.draft_cache)
        answer = draft_answers(d_fwd, d_cache, d_first, budget=budget, eos_ids=eos_ids,
                               sampler=spec.draft_sampler(sampler), args=args, num_new=shape.draft_new)
        d_tokens, d_len = answer.tokens, answer.length
        bounds, count = segment_draft(answer, judge.table, spec, price=judge.prefix_price)
        t_fwd = forward_fn(target, target_params, return_hidden=True)
        cache, first_logits = prefill(forward_fn(target, target_params), target_cfg, prompt, prompt_lens,
                                      shape.cache_len)
        s_len = judge.suffix.shape[0]
        zeros = jnp.zeros((b,), jnp.int32)
        state = SegmentState(cache=cache, first_logits=first_logits, accepted=zeros, stopped=zeros > 0,
                             k=jnp.int32(0), passes=jnp.int32(1), block_tokens=zeros)

        def active(s: SegmentState):
            return ~s.stopped & (s.k < count)

        def cond(s: SegmentState):
            return jnp.any(active(s))

        def body(s: SegmentState):
            on = active(s)
            start = jnp.where(s.k > 0, bounds[rows, jnp.maximum(s.k - 1, 0)], 0)
            end = bounds[rows, jnp.minimum(s.k, spec.max_prefixes - 1)]
            seg_len = jnp.where(on, end - start, 1)
            idx = jnp.clip(start[:, None] + jnp.arange(shape.draft_new)[None, :], 0, shape.draft_new - 1)
            seg = jnp.where(on[:, None], jnp.take_along_axis(d_tokens, idx, axis=1), 0)

            def pass_of(length: int):
                def run_pass(cache):
                    block = pack_block(cache.lengths, seg, seg_len, seg_len[:, None], jnp.ones((b,), jnp.int32),
                                       judge.suffix, length)
                    scores, logits, cache, _ = verify_block(t_fwd, cache, block, judge.yes_id, judge.no_id)
                    return scores[:, 0], logits[:, 0], cache
                return run_pass

            needed = jnp.max(seg_len) + s_len
            branch = jnp.minimum(jnp.sum(jnp.asarray(shape.lengths) < needed), len(shape.lengths) - 1)
            score, logits, cache = jax.lax.switch(branch, [pass_of(n) for n in shape.lengths], s.cache)
            ok = on & passes(score, judge.threshold)
            failed = on & ~ok
            return s.replace(
                cache=cache.commit(jnp.where(on, seg_len, 0)),
                first_logits=jnp.where(ok[:, None], logits, s.first_logits),
                accepted=jnp.where(ok, end, s.accepted),
                stopped=s.stopped | (failed if spec.policy == "earliest_error" else False),
                k=s.k + 1, passes=s.passes + 1, block_tokens=s.block_tokens + jnp.where(on, seg_len + s_len, 0))

        s = jax.lax.while_loop(cond, body, state)
        # roll back whatever was committed past the accepted prefix (a failed segment, or longest_valid's tail)
        cache = s.cache.set_lengths(prompt_lens + s.accepted)
        remaining = jnp.where(ends_in_eos(d_tokens, s.accepted, eos_ids) | (max_new <= 0), 0,
                              jnp.maximum(max_new - s.accepted, 0))
        return {"draft": d_tokens, "cache": cache, "first_logits": s.first_logits, "live": remaining > 0,
                "stop": boundary_stop(s.first_logits, remaining, eos_ids, sampler), "remaining": remaining,
                "accepted": s.accepted, "prefixes": count, "draft_len": d_len,
                "block_tokens": s.block_tokens + prompt_lens, "verify_passes": s.passes}

    return verify


@functools.cache
def sequential_program(pair: PairSpec, spec: RoundSpec, shape: SequentialShape, sampler: Sampler):
    """Verification, then the target's continuation, in one program."""
    verify = sequential_verify(pair, spec, shape, sampler)
    cont_spec = ContinueSpec(pair.target, pair.target_impl, shape.num_new, sampler)

    def run(target_params, draft_params, prompts: Prompts, eos_ids, judge: Judge, args: SamplingArgs):
        v = verify(target_params, draft_params, prompts, eos_ids, judge, args)
        start = EagleContext(tokens=None, features=None, length=v["cache"].lengths, first_logits=v["first_logits"])
        cont, cont_n, extra = continuation(cont_spec, target_params, None, v["cache"], start,
                                           remaining=v["remaining"], eos_ids=eos_ids,
                                           args=args)
        out = join(v["draft"], v["accepted"], cont, shape.draft_new + shape.num_new)
        keep = ("accepted", "prefixes", "draft_len", "block_tokens", "verify_passes")
        return {"tokens": out, "num_new": v["accepted"] + cont_n, "continued": v["live"] & ~v["stop"],
                **{k: v[k] for k in keep}, **extra}

    return register_program(jax.jit(run))


def sequential_shape(ctx: ModeContext, prompt_len: int, max_new: int) -> SequentialShape:
    """The static shapes of mode `sequential` for prompts padded to `prompt_len` and a budget of `max_new`."""
    cap = ctx.config.max_draft_tokens  # static; each row drafts min(cap, its budget)
    d = bucket(min(cap, max_new), 16)
    lengths = block_lengths(d + len(ctx.suffix_ids))
    return SequentialShape(draft_cap=cap, draft_new=d, draft_cache=length_bucket(prompt_len + d), lengths=lengths,
                           cache_len=length_bucket(max(prompt_len + d + lengths[-1], prompt_len + max_new + 1)),
                           num_new=bucket(max_new, 16))


def sequential_launch(ctx: ModeContext, req: Request):
    """(program, args) of mode `sequential` for `req`, not run (`parse_jax.lowering` lowers it)."""
    ids, target = req.ids, ctx.target
    b, p = bucket(len(ids), 1), bucket(max(len(x) for x in ids))
    shape = sequential_shape(ctx, p, req.max_new)
    program = sequential_program(PairSpec.of(ctx), ctx.round_spec, shape, req.sampling.sampler)
    return program, (target.params, ctx.draft.params, device_prompts(target, ids, b, p, req.budget_list()), req.eos,
                     ctx.judge, req.sampling.args(b))


def serve(ctx: ModeContext, req: Request, max_batch: int, *, budgets: list[int] | None = None) -> GenerateResult | None:
    """Mode `sequential` by continuous batching through `max_batch` slots: a request's segments are verified at its
    admission, its continuation runs in the slots (None on a sharded target: it runs fixed batches)."""
    if ctx.target.mesh is not None:
        return None
    shape = sequential_shape(ctx, bucket(max(len(x) for x in req.ids)), req.max_new)
    verify = sequential_verify(PairSpec.of(ctx), ctx.round_spec, shape, req.sampling.sampler)
    return serve_verified(ctx, req, max_batch, verify=verify, draft_new=shape.draft_new, num_new=shape.num_new,
                          cache_len=shape.cache_len, budgets=budgets)


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    """Mode `sequential`: one program, one target pass per segment."""
    program, args = sequential_launch(ctx, req)
    b = bucket(len(req.ids), 1)
    t0 = time.perf_counter()
    res = fetch(program(*args))
    seconds = time.perf_counter() - t0
    n = len(req.ids)
    passes = int(res["verify_passes"])
    return parse_result(ctx, req, res, seconds, verify_passes=passes,
                        target_passes=passes + int(res["continue_passes"]),
                        continue_batch=b if res["continued"][:n].any() else 0)
