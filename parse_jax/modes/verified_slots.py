"""Continuous batching of the modes that verify once and then let the target write the rest token by token
(single-round `parse`, `sequential`): a request's verification runs when it is admitted into a slot, and its
continuation shares the slots' plain decoding (`runtime/slots.decode_slots`) with every other request in flight.

Admission: the mode's verification on up to k waiting prompts (k bucketed), then each row's accepted prefix, the
target's cache holding it and the first continuation token written into the free slots (one program). Advance:
one-token steps over every slot until enough are free. Both compile once per run's shapes; a row reads only its
own cache row, so greedy outputs equal each prompt alone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.models.decoder import Decoder
from parse_jax.modes.context import ModeContext, PairSpec, parse_result
from parse_jax.runtime.decode import is_eos
from parse_jax.runtime.programs import bucket, fetch, forward_fn, register_program
from parse_jax.runtime.requests import PAD_ID, GenerateResult, Prompts, Request
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.runtime.slots import (
    Admission,
    SlotBook,
    SlotState,
    admission,
    decode_slots,
    empty_state,
    put_rows,
    request_budgets,
    rows_by_request,
    serve_loop,
)

# the per-row counters of a verification that a PARSE-family result reads (parse_result)
ROW_STATS = ("accepted", "prefixes", "draft_len", "block_tokens", "rejected_at", "score_hist")

Verify = Callable[..., dict]  # (target_params, draft_params, prompts, eos_ids, judge, args) -> dict


def boundary_rows(v: dict, max_new: jax.Array, eos_ids: jax.Array, *, width: int, sampler: Sampler,
                  args: SamplingArgs, steps: jax.Array) -> SlotState:
    """Slot rows after a verification: the accepted draft prefix, then (where the row has tokens left) the first
    continuation token drawn from the target's logits after it; a row whose answer ended, or whose budget is spent,
    is done."""
    draft, accepted, live = v["draft"], v["accepted"], v["live"]
    k, d = draft.shape
    tok = sampler.sample(v["first_logits"], args)
    keep = jnp.arange(d)[None] < accepted[:, None]
    tokens = jnp.concatenate([jnp.where(keep, draft, PAD_ID), jnp.full((k, width - d), PAD_ID, jnp.int32)], axis=1)
    tokens = tokens.at[jnp.arange(k), accepted].set(jnp.where(live, tok, PAD_ID))
    num = accepted + live.astype(jnp.int32)
    done = ~live | is_eos(tok, eos_ids) | (num >= max_new)
    return SlotState(cache=v["cache"], tokens=tokens, num_new=num, done=done, last=tok, max_new=max_new, steps=steps)


@functools.cache
def slot_programs(pair: PairSpec, verify: Verify, width: int, sampler: Sampler):
    """(admit, advance) of one run's shapes; the slot state is donated to both. `admit` also returns the admitted
    rows' verification counters (ROW_STATS present in the verification, and its `verify_passes`)."""
    target = Decoder(pair.target, pair.target_impl)

    def admit(target_params, draft_params, state: SlotState, adm: Admission, eos_ids, judge, args: SamplingArgs):
        prompts = Prompts(tokens=adm.prompt, lens=adm.lens, max_new=adm.max_new)
        v = verify(target_params, draft_params, prompts, eos_ids, judge, args.fold(0).fold(adm.key_data))
        rows = boundary_rows(v, adm.max_new, eos_ids, width=width, sampler=sampler,
                             args=args.fold(1).fold(adm.key_data), steps=state.steps)
        counters = {"continued": v["live"], **{k: v[k] for k in (*ROW_STATS, "verify_passes") if k in v}}
        return put_rows(state, rows, adm.slots), counters

    def advance(target_params, state: SlotState, free_target, eos_ids, args: SamplingArgs):
        return decode_slots(forward_fn(target, target_params), state, free_target, eos_ids, args.fold(2), sampler)

    return (register_program(jax.jit(admit, donate_argnums=(2,))),
            register_program(jax.jit(advance, donate_argnums=(1,))))


def serve_verified(ctx: ModeContext, req: Request, max_batch: int, *, verify: Verify, draft_new: int, num_new: int,
                   cache_len: int, budgets: list[int] | None = None) -> GenerateResult:
    """A validated request through `max_batch` slots, verified at admission by `verify` (drafts of `draft_new`
    tokens), continued by plain decoding (`num_new` tokens past the draft at most, caches of `cache_len`).
    `budgets`: each prompt's own max_new_tokens, at most the request's."""
    ids, target = req.ids, ctx.target
    budgets = request_budgets(req, budgets)
    pair = PairSpec.of(ctx)
    width = draft_new + num_new
    admit, advance = slot_programs(pair, verify, width, req.sampling.sampler)
    used = min(max_batch, len(ids))
    slots = bucket(used, 1)
    p = bucket(max(len(x) for x in ids))
    args, params = req.sampling.args(), (target.params, ctx.draft.params)
    counters: list[tuple[list[int], dict]] = []  # each admission's requests and its counters (read once, at the end)

    def admit_at(state, batch, where, i):
        state, got = admit(*params, state, admission(ids, batch, where, prompt_len=p, max_new=budgets, index=i),
                           req.eos, ctx.judge, args)
        if batch:  # an empty one is a warm-up (runtime/slots.warm_admissions)
            counters.append((batch, got))
        return state

    t0 = time.perf_counter()
    rows, admissions, run = serve_loop(
        SlotBook(len(ids), slots, used), empty_state(pair.target, slots, width, cache_len), admit=admit_at,
        advance=lambda st, free: advance(target.params, st, free, req.eos, args),
        rows=lambda st: {"done": st.done, "num_new": st.num_new, "tokens": st.tokens, "steps": st.steps},
        warm=(admit, p))
    counted = fetch([got for _, got in counters])
    seconds = time.perf_counter() - t0
    out = {"tokens": np.stack([r["tokens"] for r in rows]), "num_new": np.array([r["num_new"] for r in rows])}
    per = rows_by_request(counters, counted, len(ids), [k for k in ("continued", *ROW_STATS) if k in counted[0]])
    out.update({k: np.stack(v) for k, v in per.items()})
    verify_passes = sum(int(got.get("verify_passes", 1)) for got in counted)
    if "rejected_at" not in out:  # sequential: a request's verification passes are its admission's
        out["own_verify_passes"] = np.zeros(len(ids), np.int64)
        for (batch, _), got in zip(counters, counted):
            out["own_verify_passes"][batch] = int(got.get("verify_passes", 1))
    steps = int(run["steps"])
    res = parse_result(ctx, req, out, seconds, verify_passes=verify_passes, target_passes=verify_passes + steps,
                       continue_batch=used)
    # a decode step carries every slot: per request, at most `used` rows' worth (rows are not tracked per step)
    res.stats.update(slots=used, admissions=admissions, request_passes=verify_passes + steps * used)
    return res


def verifier_of(program) -> Verify:
    """A single-round program built with `fused=False` as a `Verify`: its rows with tokens left (`live`) include
    those whose next token, read at the boundary, is EOS (that token is still emitted)."""

    def verify(target_params, draft_params, prompts, eos_ids, judge, args):
        out = program(target_params, draft_params, None, prompts, eos_ids, judge, args, args.key)
        return {**out, "live": (out["remaining"] > 0) | out["stop"], "first_logits": out["context"].first_logits}

    return verify


verifier_of = functools.cache(verifier_of)
