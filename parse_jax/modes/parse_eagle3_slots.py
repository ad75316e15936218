"""Continuous batching of mode `parse+eagle3`. Multi round: every round in the slots (`modes/parse_multi.serve_multi`).
Single round (`modes/verified_slots.run_ahead`): a request's verification runs when it is admitted, staged
(`modes/verified_slots.admit_staged`: the draft, then one pass over every prefix with the taps EAGLE-3 reads, over
the one block length the draft needs), the head's first pass starts its continuation from the
accepted boundary (`eagle_start`), and EAGLE-3 rounds (`eagle_round`) advance every slot until enough are free.
Admissions verify ahead of the free slots as single-round parse's do (`modes/verified_slots`: rows whose draft is
accepted whole end there and never take a slot; rows that continue wait in a park for the next free slot). The
programs compile once per run's shapes (and block length); a row reads only its own cache rows, so greedy outputs
equal each prompt alone.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.modes.context import ModeContext, parse_result
from parse_jax.modes.parse import SingleRound, single_round, staged_single_round
from parse_jax.modes.parse_multi import serve_multi
from parse_jax.modes.verified_slots import (
    ROW_STATS,
    AheadBook,
    AheadSlots,
    admit_staged,
    place,
    place_program,
    run_ahead,
)
from parse_jax.runtime.programs import bucket, committed, register_program
from parse_jax.runtime.requests import PAD_ID, GenerateResult, Prompts, Request
from parse_jax.runtime.sampling import SamplingArgs
from parse_jax.runtime.slots import Admission, admission, request_budgets, rows_by_request
from parse_jax.speculation.eagle3 import EagleLoop, eagle_start, head_applies
from parse_jax.speculation.eagle3.serve import EagleServeShape, EagleSlots, empty_slots, serve_programs


def slots_shape_of(rnd: SingleRound) -> EagleServeShape:
    """The EAGLE-3 slots of a run of `rnd`'s single round."""
    pair, eagle = rnd.pair, rnd.eagle
    loop = EagleLoop.of(eagle.config, eagle, num_new=rnd.shape.num_new)
    return EagleServeShape(pair.target, pair.target_impl, rnd.shape.cache_len, loop, rnd.sampler)


@functools.cache
def admit_program(rnd: SingleRound, length: int):
    """The admission of a run that verifies ahead (`modes/verified_slots`), the state donated: it verifies an
    admission's drafted rows over blocks of `length` tokens (staged: `modes/parse.staged_single_round`), starts
    their EAGLE-3 continuation and places them, returning the state, each candidate's destination, the admitted
    rows' outputs (those that ended there are read from them) and their verification counters and drafts."""
    pair, shape, sampler, eagle = rnd.pair, rnd.shape, rnd.sampler, rnd.eagle
    verify = staged_single_round(rnd).verifier(length)
    loop = slots_shape_of(rnd).loop

    def admit(weights, ahead: AheadSlots, adm: Admission, eos_ids, judge, args: SamplingArgs, drafted):
        target_params, draft_params, head_params = weights
        prompts = Prompts(tokens=adm.prompt, lens=adm.lens, max_new=adm.max_new)
        own = args.with_keys(adm.keys)
        out = verify(target_params, draft_params, prompts, eos_ids, judge, own, drafted)
        budget = jnp.where(out["stop"], 1, out["remaining"])  # a boundary whose next token is EOS still emits it
        fns = head_applies(pair.target, eagle.config, pair.target_impl, target_params, head_params)
        state = eagle_start(fns, out["cache"], out["context"], loop=loop, max_new=budget, eos_ids=eos_ids,
                            sampler=sampler, args=own.fold(1))
        counters = {"draft": out["draft"], "continued": out["remaining"] > 0, **{k: out[k] for k in ROW_STATS}}
        rows = EagleSlots(state=state, max_new=budget)
        ahead, where = place(ahead, rows)
        return ahead, where, slot_outputs(rows, shape.num_new), counters

    return register_program(jax.jit(admit, donate_argnums=(1,)))


@functools.cache
def advance_program(slots_shape: EagleServeShape):
    """EAGLE-3 rounds over every slot until enough are free, the state donated."""
    _, advance_slots = serve_programs(slots_shape)

    def advance(target_params, head_params, ahead: AheadSlots, free_target, eos_ids, args: SamplingArgs):
        return ahead.replace(slots=advance_slots(target_params, head_params, ahead.slots, free_target, eos_ids,
                                                 args))

    return register_program(jax.jit(advance, donate_argnums=(2,)))


def slot_outputs(slots: EagleSlots, num_new: int) -> dict:
    """What the host reads of each slot (or admitted row): its continuation and EAGLE-3 counters ("drafts": the
    EAGLE-3 passes the row was live in); "rounds" is the run's EAGLE-3 passes (a scalar)."""
    st = slots.state
    return {"done": st.done, "tokens": st.tokens[:, :num_new], "num_new": st.num_new, "accepted": st.accepted,
            "proposed": st.proposed, "drafts": st.drafts, "rounds": st.rounds}


def serve(ctx: ModeContext, req: Request, max_batch: int, *, budgets: list[int] | None = None) -> GenerateResult | None:
    """Mode `parse+eagle3` through `max_batch` slots, multi or single round as `ParseConfig.rounds` says (None on
    a sharded target: it runs fixed batches). `budgets`: each prompt's own budget, at most the request's."""
    if ctx.target.mesh is not None:
        return None
    if ctx.config.rounds == "multi":
        return serve_multi(ctx, req, max_batch, budgets=budgets, eagle=True)
    ids, target = req.ids, ctx.target
    budgets = request_budgets(req, budgets)
    p = bucket(max(len(x) for x in ids))
    rnd = single_round(ctx, req, eagle=True)
    shape = rnd.shape
    staged = staged_single_round(rnd)
    slots_shape = slots_shape_of(rnd)
    place_parked, advance = place_program(), advance_program(slots_shape)
    args, keys, eos = req.sampling.args(1), req.sampling.keys(len(ids)), req.eos
    weights = (target.params, ctx.draft.params, ctx.head.params)
    used = min(max_batch, len(ids))
    slots = bucket(used, 1)
    book = AheadBook(len(ids), slots, used)
    empty = empty_slots(slots_shape, target.params, ctx.head.params, slots, p, eos, args)
    # the park: rows shaped as the slots', each leaf its own buffer (the state is donated); only rows below the
    # parked count are read
    park = jax.tree.map(lambda x: jnp.zeros((book.park, *x.shape[1:]) if jnp.ndim(x) else (), x.dtype), empty)
    state = committed(AheadSlots(slots=empty, park=park, parked=jnp.int32(0), capacity=jnp.int32(used)),
                      weights)

    def admit_rows(ahead, batch, where, i):
        adm = admission(ids, batch, where, prompt_len=p, max_new=budgets, keys=keys)
        return admit_staged(staged, ahead, (ctx.draft.params, adm, eos, ctx.judge, args), warm_up=not batch,
                            admit_at=lambda n, st, drafted: admit_program(rnd, n)(weights, st, adm, eos, ctx.judge,
                                                                                  args, drafted))

    t0 = time.perf_counter()
    run, admissions, counters = run_ahead(
        book, state, place=place_parked,
        admit=admit_rows, advance=lambda st, free: advance(target.params, ctx.head.params, st, free, eos, args),
        read=lambda st: slot_outputs(st, shape.num_new), warm=(staged, p))
    counted = [got for _, got in counters]
    seconds = time.perf_counter() - t0
    per = rows_by_request(counters, counted, len(ids), ("draft", "continued", *ROW_STATS))
    tokens = []
    for r, row in enumerate(book.out):
        a = int(per["accepted"][r])
        tokens.append(per["draft"][r][:a].tolist() + row["tokens"][: row["num_new"]].tolist())
    width = max(max(len(t) for t in tokens), 1)
    live = np.array(per["continued"], bool)
    out = {"tokens": np.array([t + [PAD_ID] * (width - len(t)) for t in tokens], np.int32),
           "num_new": np.array([len(t) for t in tokens], np.int32),
           **{k: np.stack(per[k]) for k in ("continued", *ROW_STATS)},
           "eagle3_accepted_tokens": np.where(live, [r["accepted"] for r in book.out], 0),
           "eagle3_draft_tokens": np.where(live, [r["proposed"] for r in book.out], 0)}
    steps = int(run["rounds"])
    res = parse_result(ctx, req, out, seconds, verify_passes=admissions, target_passes=admissions + steps,
                       continue_batch=used)
    # each request's passes as it counts alone: its verification, then the EAGLE-3 passes its continuation was in
    res.stats.update(slots=used, admissions=admissions, parked=len(book.ever_parked),
                     request_passes=len(ids) + int(np.sum(np.where(live, [r["drafts"] for r in book.out], 0))))
    return res
