"""Mode `parse` (and `parse+eagle3`): the draft writes a whole answer, ONE target pass scores every step-prefix,
the longest valid prefix is kept and the target continues from it (single round), or the target writes up to its
next step boundary and the draft drafts again (multi round, one `lax.while_loop`).

Each request batch runs as one jitted program that returns everything the result needs; the host encodes before and
decodes after, with one transfer of the results (`programs.fetch`). At batch > 1 off a mesh the single round runs
staged (`staged_single_round`): the draft, then, the host having read the block length it needs, the pass over that
one length (one program over every length sets them all up); then it stops once more, to continue only the rows that
still have tokens to write in a smaller batch (where the decode step is compute-bound, that is cheaper than carrying
finished rows).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder
from parse_jax.modes.context import Launch, ModeContext, PairSpec, parse_result
from parse_jax.modes.parse_multi import (  # noqa: F401  (EagleSpec, multi_launch re-exported)
    EagleSpec,
    eagle_spec,
    multi_launch,
    run_multi,
    serve_multi,
)
from parse_jax.modes.verified_slots import Staged, serve_verified, verified_rows
from parse_jax.runtime.decode import decode_loop, is_eos, prefill
from parse_jax.runtime.programs import bucket, fetch, forward_fn, length_bucket, register_program, take_rows
from parse_jax.runtime.requests import PAD_ID, GenerateResult, Prompts, Request, device_prompts
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.speculation.eagle3 import EagleContext, EagleLoop, eagle_loop, head_applies
from parse_jax.verify.round import (
    Draft,
    Judge,
    PassShape,
    RoundSpec,
    Verified,
    block_lengths,
    draft_answers,
    ends_in_eos,
    join,
    pick_length,
    segmented,
    verify_round,
)


@dataclasses.dataclass(frozen=True)
class SingleShape:
    """Static shapes of a single-round program."""

    draft_cap: int     # the most draft tokens (max_draft_tokens, within the request's budget)
    draft_new: int     # its bucket
    draft_cache: int
    lengths: tuple[int, ...]  # verification block buckets (prompt + draft + K suffix copies), see block_lengths
    cache_len: int     # the target's cache
    num_new: int       # continuation tokens (bucket)


@dataclasses.dataclass(frozen=True)
class ContinueSpec:
    """The static settings of the target's continuation from an accepted boundary: token by token, or with EAGLE-3
    (`eagle`)."""

    target: ModelConfig
    target_impl: str
    num_new: int
    sampler: Sampler
    eagle: EagleSpec | None = None


def _round_stats(v, draft_len) -> dict:
    return {"accepted": v.accepted, "prefixes": v.prefixes, "draft_len": draft_len, "block_tokens": v.block_tokens,
            "rejected_at": v.rejected_at, "score_hist": v.score_hist}


@dataclasses.dataclass(frozen=True)
class SingleRound:
    """The static settings of one single-round program: the pair, the round, its shapes, the sampler and (parse+eagle3)
    the EAGLE-3 head whose taps the pass returns."""

    pair: PairSpec
    spec: RoundSpec
    shape: SingleShape
    sampler: Sampler
    eagle: EagleSpec | None = None


def draft_stage(rnd: SingleRound, draft_params, prompts: Prompts, *, eos_ids, args: SamplingArgs) -> Draft:
    """The draft's whole answer to each prompt (a single round's first stage): at most min(draft_cap, budget)."""
    pair, shape = rnd.pair, rnd.shape
    budget = jnp.where(prompts.max_new > 0, jnp.minimum(shape.draft_cap, prompts.max_new), 0)
    d_fwd = forward_fn(Decoder(pair.draft, pair.draft_impl), draft_params)
    d_cache, d_first = prefill(d_fwd, pair.draft, prompts.tokens, prompts.lens, shape.draft_cache)
    return draft_answers(d_fwd, d_cache, d_first, budget=budget, eos_ids=eos_ids,
                         sampler=rnd.spec.draft_sampler(rnd.sampler), args=args, num_new=shape.draft_new)


def verify_stage(rnd: SingleRound, target_params, prompts: Prompts, answer: Draft, judge: Judge, *, eos_ids,
                 length: int | None = None) -> tuple[Verified, jax.Array]:
    """A single round's verification of `answer` over an empty cache (the prompt is the block's head) -> (the pass,
    each row's tokens left to write: 0 where the accepted prefix ends in EOS or the budget is spent). `length`: the
    one block bucket the pass takes (its block and taps still padded to the longest), else the shortest of the
    shape's buckets that holds every row's block, picked on the device."""
    pair, shape = rnd.pair, rnd.shape
    t_forward = forward_fn(Decoder(pair.target, pair.target_impl), target_params, return_hidden=True)
    cache = KVCache.init(pair.target, prompts.tokens.shape[0], shape.cache_len)
    lengths = shape.lengths if length is None else (length,)
    taps = rnd.eagle.config.taps if rnd.eagle is not None else ()
    v = verify_round(t_forward, cache, judge, head=prompts.tokens, head_len=prompts.lens, draft=answer,
                     spec=rnd.spec, shape=PassShape(lengths, taps, width=shape.lengths[-1]))
    remaining = jnp.where(ends_in_eos(answer.tokens, v.accepted, eos_ids) | (prompts.max_new <= 0), 0,
                          jnp.maximum(prompts.max_new - v.accepted, 0))
    return v, remaining


def split_outputs(v: Verified, answer: Draft, remaining: jax.Array, eos_ids, sampler: Sampler) -> dict:
    """What a staged single round's pass returns at its boundary, for the continuation (`continue_single`, or a
    served run's slots): greedy, a row whose next token is EOS is finished here, without taking a continuation row."""
    first = jnp.argmax(v.first_logits, axis=-1).astype(jnp.int32)
    stop = boundary_stop(v.first_logits, remaining, eos_ids, sampler)
    return {"draft": answer.tokens, "remaining": jnp.where(stop, 0, remaining), "stop": stop, "first": first,
            "cache": v.cache, "context": boundary(v), **_round_stats(v, answer.length)}


def boundary_stop(first_logits: jax.Array, remaining: jax.Array, eos_ids, sampler: Sampler) -> jax.Array:
    """Greedy, the rows with tokens left whose next token, read from the verification pass at the boundary
    (`first_logits`), is EOS: they end there, that token emitted without a continuation pass (not counted as
    continued, in parse and sequential, fused or served)."""
    if not sampler.greedy:
        return jnp.zeros(remaining.shape, bool)
    return is_eos(jnp.argmax(first_logits, axis=-1).astype(jnp.int32), eos_ids) & (remaining > 0)


@functools.cache
def single_round_program(rnd: SingleRound):
    """Draft -> segment -> pack -> verify -> accept -> commit -> the continuation, in one program: a batch of one
    row, or on a mesh (a batch > 1 runs staged, `staged_single_round`)."""
    pair, shape, sampler, eagle = rnd.pair, rnd.shape, rnd.sampler, rnd.eagle
    cont_spec = ContinueSpec(pair.target, pair.target_impl, shape.num_new, sampler, eagle)

    def run(target_params, draft_params, head_params, prompts: Prompts, eos_ids, judge: Judge, args: SamplingArgs):
        answer = draft_stage(rnd, draft_params, prompts, eos_ids=eos_ids, args=args)
        v, remaining = verify_stage(rnd, target_params, prompts, answer, judge, eos_ids=eos_ids)
        cont, cont_n, extra = continuation(cont_spec, target_params, head_params, v.cache, boundary(v),
                                           remaining=remaining, eos_ids=eos_ids, args=args)
        out = join(answer.tokens, v.accepted, cont, shape.draft_new + shape.num_new)
        continued = (remaining > 0) & ~boundary_stop(v.first_logits, remaining, eos_ids, rnd.sampler)
        return {"tokens": out, "num_new": v.accepted + cont_n, "continued": continued,
                **_round_stats(v, answer.length), **extra}

    return register_program(jax.jit(run))


def boundary(v: Verified) -> EagleContext:
    """What the continuation starts from after a verification pass: the block (EAGLE-3 reads its taps), the
    committed length and the target's logits at the accepted boundary."""
    return EagleContext(tokens=v.tokens, features=v.features, length=v.cache.lengths, first_logits=v.first_logits)


def continuation(spec: ContinueSpec, target_params, head_params, cache: KVCache, ctx: EagleContext, *,
                 remaining: jax.Array, eos_ids: jax.Array, args: SamplingArgs):
    """The target writes each row's `remaining` tokens from its accepted boundary: token by token, or with EAGLE-3
    from the taps of the verification pass. -> (tokens [B, num_new], count [B], stats). It draws from stream 1 of
    each row's key in `args` (the draft drew from the key itself), as a served run's slots do."""
    args = args.fold(1)
    if spec.eagle is None:
        forward = forward_fn(Decoder(spec.target, spec.target_impl), target_params)
        state = decode_loop(forward, cache, ctx.first_logits, max_new=remaining, eos_ids=eos_ids,
                            sampler=spec.sampler, args=args, num_new=spec.num_new)
        return state.tokens, state.num_new, {"continue_passes": state.step - 1}
    eagle = spec.eagle
    fns = head_applies(spec.target, eagle.config, spec.target_impl, target_params, head_params)
    loop = EagleLoop.of(eagle.config, eagle, num_new=spec.num_new)
    state = eagle_loop(fns, cache, ctx, loop=loop, max_new=remaining,
                       eos_ids=eos_ids, sampler=spec.sampler, args=args)
    live = remaining > 0
    return state.tokens[:, :spec.num_new], state.num_new, {
        "continue_passes": state.rounds, "eagle3_accepted_tokens": jnp.where(live, state.accepted, 0),
        "eagle3_draft_tokens": jnp.where(live, state.proposed, 0)}


@functools.cache
def continue_single(spec: ContinueSpec):
    """The continuation of a staged single round, on the rows picked by the host."""

    def run(target_params, head_params, cache, ctx: EagleContext, remaining, eos_ids, args: SamplingArgs):
        cont, cont_n, extra = continuation(spec, target_params, head_params, cache, ctx, remaining=remaining,
                                           eos_ids=eos_ids, args=args)
        return {"tokens": cont, "num_new": cont_n, **extra}

    return register_program(jax.jit(run))


def host_rows(remaining: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(rows, their budgets) to continue after a staged single round: the rows with tokens left, padded to a batch
    bucket with repeats of a live row whose budget is 0 (None when no row has tokens left). A sharded target never
    gets here: it runs the fused program, its rows laid out over `data`."""
    live = np.flatnonzero(remaining > 0)
    if live.size == 0:
        return None, remaining[:0]
    if bucket(live.size, 1) >= remaining.shape[0]:
        return np.arange(remaining.shape[0]), remaining
    pad = bucket(live.size, 1) - live.size
    rows = np.concatenate([live, np.full(pad, live[0])]).astype(np.int32)
    return rows, np.concatenate([remaining[live], np.zeros(pad, remaining.dtype)])


# ------------------------------------------------------------------------------------------------ host side


def single_shape(ctx: ModeContext, prompt_len: int, max_new: int, eagle: bool = False) -> SingleShape:
    """The static shapes of a single round for prompts padded to `prompt_len` and a budget of `max_new`."""
    cfg, p = ctx.config, prompt_len
    cap = cfg.max_draft_tokens  # static; each row drafts min(cap, its budget)
    d = bucket(min(cap, max_new), 16)
    lengths = block_lengths(p + d + ctx.round_spec.max_prefixes * len(ctx.suffix_ids))
    margin = eagle_spec(ctx).loop_slots if eagle else 1  # an EAGLE-3 round writes past its last token
    return SingleShape(draft_cap=cap, draft_new=d, draft_cache=length_bucket(p + d), lengths=lengths,
                       cache_len=length_bucket(max(lengths[-1], p + max_new + margin)), num_new=bucket(max_new, 16))


def single_round(ctx: ModeContext, req: Request, eagle: bool = False) -> SingleRound:
    """The single round of `req`: its shapes from its longest prompt's bucket and its budget."""
    shape = single_shape(ctx, bucket(max(len(x) for x in req.ids)), req.max_new, eagle)
    return SingleRound(PairSpec.of(ctx), ctx.round_spec, shape, req.sampling.sampler,
                       eagle_spec(ctx) if eagle else None)


def runs_fused(ctx: ModeContext, req: Request) -> bool:
    """Whether a fixed batch of `req` runs its single round as one program (a batch of one row, or on a mesh: a
    sharded target keeps its whole batch anyway), else staged (`staged_launch`)."""
    return bucket(len(req.ids), 1) == 1 or ctx.target.mesh is not None


def _request_prompts(ctx: ModeContext, req: Request) -> Prompts:
    """`req`'s prompts on the device, padded to its batch and prompt buckets."""
    return device_prompts(ctx.target, req.ids, bucket(len(req.ids), 1), bucket(max(len(x) for x in req.ids)),
                          req.budget_list())


def single_launch(ctx: ModeContext, req: Request, eagle: bool = False) -> Launch:
    """The fused single-round program for `req` (`runs_fused`)."""
    rnd = single_round(ctx, req, eagle)
    args = (ctx.target.params, ctx.draft.params, ctx.head.params if eagle else None,
            _request_prompts(ctx, req), req.eos, ctx.judge, req.sampling.args(bucket(len(req.ids), 1)))
    return Launch(single_round_program(rnd), args)


@dataclasses.dataclass(frozen=True)
class StagedLaunch:
    """A fixed batch's staged single round (`staged_single_round`): its stages, shapes, the target's params and the
    draft program's arguments (draft_params, prompts, eos_ids, judge, args); the pass takes the same after the
    target's params, and the drafted answer last (`pass_args`)."""

    staged: Staged
    shape: SingleShape
    target_params: object
    draft_args: tuple

    def pass_args(self, answer: Draft) -> tuple:
        return (self.target_params, *self.draft_args, answer)


def staged_launch(ctx: ModeContext, req: Request, eagle: bool = False) -> StagedLaunch:
    """The staged single round of `req` as a fixed batch that does not run fused runs it (`run_single`)."""
    rnd = single_round(ctx, req, eagle)
    return StagedLaunch(staged_single_round(rnd), rnd.shape, ctx.target.params,
                        (ctx.draft.params, _request_prompts(ctx, req), req.eos, ctx.judge,
                         req.sampling.args(bucket(len(req.ids), 1))))

def run(ctx: ModeContext, req: Request) -> GenerateResult:
    """Mode `parse`: single- or multi-round PARSE, as `ParseConfig.rounds` says."""
    return run_multi(ctx, req) if ctx.config.rounds == "multi" else run_single(ctx, req)


def serve(ctx: ModeContext, req: Request, max_batch: int, *, budgets: list[int] | None = None) -> GenerateResult | None:
    """Mode `parse` by continuous batching through `max_batch` slots: multi round, every round in the slots; single
    round, the verification at admission and the continuation in the slots (None on a sharded target: its slot
    caches are not laid out over the mesh, so it runs fixed batches). `budgets`: each prompt's own budget."""
    if ctx.target.mesh is not None:
        return None
    if ctx.config.rounds == "multi":
        return serve_multi(ctx, req, max_batch, budgets=budgets)
    rnd = single_round(ctx, req)
    shape = rnd.shape
    return serve_verified(ctx, req, max_batch, verify=staged_single_round(rnd), draft_new=shape.draft_new,
                          num_new=shape.num_new, cache_len=shape.cache_len, budgets=budgets)


@functools.cache
def staged_single_round(rnd: SingleRound) -> Staged:
    """A single round that stops on the host (a batch > 1, a served admission) as two programs
    (`verified_slots.Staged`): the draft, cut into its prefixes, and the block length its pass needs; then the pass
    over that one length (with EAGLE-3's taps where `rnd.eagle`), so that a run sets up only the lengths it meets."""

    def draft(draft_params, prompts: Prompts, eos_ids, judge: Judge, args: SamplingArgs):
        answer = draft_stage(rnd, draft_params, prompts, eos_ids=eos_ids, args=args)
        return segmented(answer, prompts.lens, judge, rnd.spec)

    return Staged(draft=draft, verifier=functools.partial(_staged_verifier, rnd), lengths=rnd.shape.lengths)


@functools.cache
def stage_program(stage):
    """A stage of `staged_single_round` (its draft, or its pass over one length) as a program of its own: what a
    fixed batch runs (a served run runs them inside its admission's programs)."""
    return register_program(jax.jit(stage))


@functools.cache
def _staged_verifier(rnd: SingleRound, length: int):
    """`staged_single_round`'s pass over blocks of `length` tokens."""

    def verify(target_params, draft_params, prompts: Prompts, eos_ids, judge: Judge, args: SamplingArgs,
               answer: Draft):
        v, remaining = verify_stage(rnd, target_params, prompts, answer, judge, eos_ids=eos_ids, length=length)
        return verified_rows(split_outputs(v, answer, remaining, eos_ids, rnd.sampler))

    return verify


def run_eagle3(ctx: ModeContext, req: Request) -> GenerateResult:
    """Mode `parse+eagle3`: PARSE whose target writes with the target's EAGLE-3 head, from the taps of the
    verification pass: the rest of the answer (single round), or each round's step (multi round)."""
    return run_multi(ctx, req, eagle=True) if ctx.config.rounds == "multi" else run_single(ctx, req, eagle=True)


def run_single(ctx: ModeContext, req: Request, eagle: bool = False) -> GenerateResult:
    """Single-round PARSE (mode parse, rounds single; mode parse+eagle3 with `eagle`)."""
    ids, target = req.ids, ctx.target
    b = bucket(len(ids), 1)
    head_params = ctx.head.params if eagle else None
    if runs_fused(ctx, req):
        launch = single_launch(ctx, req, eagle)
        t0 = time.perf_counter()
        res = fetch(launch.program(*launch.args))
        batch = b if res["continued"][: len(ids)].any() else 0
    else:  # staged: the draft, then the pass over the one block length it needs
        launch = staged_launch(ctx, req, eagle)
        num_new = launch.shape.num_new
        t0 = time.perf_counter()
        answer, needed = stage_program(launch.staged.draft)(*launch.draft_args)
        length = pick_length(launch.staged.lengths, int(fetch(needed)))
        out = stage_program(launch.staged.verifier(length))(*launch.pass_args(answer))
        remaining = fetch(out["remaining"])  # the host step: which rows the continuation takes
        rows, rem = host_rows(remaining)
        cont = None
        if rows is not None:
            state = (out["cache"], out["context"])
            if len(rows) < b:
                state = take_rows(state, rows)
            spec = ContinueSpec(target.config, target.attention_impl, num_new, req.sampling.sampler,
                                eagle_spec(ctx) if eagle else None)
            args = req.sampling.args(b)
            cont = continue_single(spec)(target.params, head_params, *state, rem, req.eos,
                                         args.with_keys(args.key[rows]))  # each continued row its own key
        res, cont = fetch(({k: v for k, v in out.items() if k not in ("cache", "context", "live", "first_logits")},
                           cont))
        res = _assemble_split(res, cont, rows, rem, num_new)
        res["continued"] = remaining > 0
        batch = 0 if rows is None else len(rows)
    seconds = time.perf_counter() - t0
    return parse_result(ctx, req, res, seconds, verify_passes=1, target_passes=1 + int(res["continue_passes"]),
                        continue_batch=batch)


def _assemble_split(res: dict, cont: dict | None, rows, rem, num_new: int) -> dict:
    """The tokens of a staged single round: accepted draft, then the EOS found at the boundary or the continuation."""
    b, d = res["draft"].shape
    tokens = np.full((b, d + num_new), PAD_ID, np.int32)
    count = np.zeros(b, np.int32)
    cont_tok = np.zeros((b, num_new), np.int32)
    cont_n = np.zeros(b, np.int32)
    if cont is not None:
        live = rem > 0
        cont_tok[rows[live]] = cont["tokens"][live, :num_new]
        cont_n[rows[live]] = cont["num_new"][live]
    for i in range(b):
        a = int(res["accepted"][i])
        tail = [int(res["first"][i])] if res["stop"][i] else cont_tok[i, : cont_n[i]].tolist()
        row = res["draft"][i, :a].tolist() + tail
        tokens[i, : len(row)] = row
        count[i] = len(row)
    out = dict(res, tokens=tokens, num_new=count)
    out["continue_passes"] = 0 if cont is None else int(cont["continue_passes"])
    for key in ("eagle3_accepted_tokens", "eagle3_draft_tokens"):
        if cont is not None and key in cont:
            vals = np.zeros(b, np.int64)
            vals[rows[rem > 0]] = cont[key][rem > 0]
            out[key] = vals
    return out
