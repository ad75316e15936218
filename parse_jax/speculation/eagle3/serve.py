"""Continuous batching of EAGLE-3 drafting (`runtime/slots.serve_loop`): `max_batch` slots stay busy over any
number of prompts. Admission: a target prefill with its taps and the head's first pass (`eagle_start`) for up to k
waiting prompts (k bucketed), their rows written into the free slots; advance: `eagle_round` on every slot until
enough are free. Both compile once per run's shapes; a row reads only its own cache rows, so greedy outputs equal
each prompt alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from parse_jax.models.config import ModelConfig
from parse_jax.runtime.programs import bucket, committed, register_program
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.runtime.slots import Admission, SlotBook, admission, put_rows, request_budgets, serve_loop
from parse_jax.settings import Eagle3Settings
from parse_jax.speculation.draft_model import served_passes, spec_batch, spec_result
from parse_jax.speculation.eagle3.decode import (
    EagleLoop,
    EagleState,
    eagle_round,
    eagle_start,
    head_applies,
    prefill_with_taps,
    tree_stats,
)
from parse_jax.speculation.eagle3.head import Eagle3

OUTPUTS = ("tokens", "num_new", "rounds", "accepted", "proposed", "drafts", "per_pos")


@struct.dataclass
class EagleSlots:
    """Every slot's EAGLE-3 state and its budget (an empty slot is done)."""

    state: EagleState
    max_new: jax.Array  # [B]

    @property
    def done(self) -> jax.Array:
        """[B] the rows that write no more tokens (a served run's free slots; `modes/verified_slots.place`)."""
        return self.state.done


@dataclasses.dataclass(frozen=True)
class EagleServeShape:
    target: ModelConfig
    impl: str
    cache_len: int
    loop: EagleLoop
    sampler: Sampler


def _start_rows(shape: EagleServeShape, target_params, head_params, prompt, lens, max_new, eos_ids,
                args: SamplingArgs) -> EagleSlots:
    """Rows of new requests: the target's prefill with its taps, then the head's pass over the context."""
    fns = head_applies(shape.target, shape.loop.config, shape.impl, target_params, head_params)
    cache, ctx = prefill_with_taps(fns, shape.target, prompt, lens, shape.cache_len)
    state = eagle_start(fns, cache, ctx, loop=shape.loop, max_new=max_new, eos_ids=eos_ids, sampler=shape.sampler,
                        args=args)
    return EagleSlots(state=state, max_new=max_new)


@functools.cache
def serve_programs(shape: EagleServeShape):
    """(admit, advance); the slot state is donated to both."""

    def admit(target_params, head_params, slots: EagleSlots, adm: Admission, eos_ids, args: SamplingArgs):
        rows = _start_rows(shape, target_params, head_params, adm.prompt, adm.lens, adm.max_new, eos_ids,
                           args.with_keys(adm.keys))
        return put_rows(slots, rows, adm.slots)

    def advance(target_params, head_params, slots: EagleSlots, free_target, eos_ids, args: SamplingArgs):
        fns = head_applies(shape.target, shape.loop.config, shape.impl, target_params, head_params)

        def body(s: EagleSlots) -> EagleSlots:
            return s.replace(state=eagle_round(fns, s.state, loop=shape.loop, max_new=s.max_new, eos_ids=eos_ids,
                                               sampler=shape.sampler, args=args))  # each slot's key: its state's

        def cond(s: EagleSlots) -> jax.Array:
            return ~jnp.all(s.state.done) & (jnp.sum(s.state.done) < free_target)

        return jax.lax.while_loop(cond, body, slots)

    return (register_program(jax.jit(admit, donate_argnums=(2,))),
            register_program(jax.jit(advance, donate_argnums=(2,))))


_SLOT_SHAPES: dict[tuple, EagleSlots] = {}


def empty_slots(shape: EagleServeShape, target_params, head_params, slots: int, prompt_len: int, eos, args):
    """Every slot empty (done), each leaf its own buffer (the state is donated), shaped as admitted rows are. The
    shapes are traced once per (shape, slots, prompt length, stop ids): tracing the prefill for them cost every
    served call 0.2-0.4 s at batch 1 on the embedded pair."""
    key = (shape, slots, prompt_len, tuple(eos.shape), str(eos.dtype))
    if key not in _SLOT_SHAPES:
        ids = jax.ShapeDtypeStruct((slots, prompt_len), jnp.int32)
        ones = jax.ShapeDtypeStruct((slots,), jnp.int32)
        keys = jax.ShapeDtypeStruct((slots, *np.shape(args.key)[1:]), np.asarray(args.key).dtype)
        _SLOT_SHAPES[key] = jax.eval_shape(functools.partial(_start_rows, shape), target_params, head_params, ids,
                                           ones, ones, eos, args.with_keys(keys))
    empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _SLOT_SHAPES[key])
    return empty.replace(state=empty.state.replace(done=jnp.ones((slots,), bool)))


def serve_eagle3(target, head: Eagle3, req: Request, eagle: Eagle3Settings, *, max_batch: int,
                 budgets: list[int] | None = None) -> GenerateResult:
    """EAGLE-3 drafting of a validated request through `max_batch` slots (mode `eagle3`) with the drafting settings
    `eagle`. `budgets`: each prompt's own max_new_tokens, at most the request's."""
    gamma = eagle.gamma
    loop = EagleLoop.of(head.config, eagle, num_new=0)
    sb = spec_batch(target, req, gamma=gamma, capacity=target.config.max_position_embeddings,
                    extra_slots=loop.slots - gamma - 1)
    shape = EagleServeShape(target.config, target.attention_impl, sb.cache_len,
                            dataclasses.replace(loop, num_new=sb.num_new), sb.sampling.sampler)
    admit, advance = serve_programs(shape)
    ids, args, keys, eos = req.ids, sb.sampling.args(1), sb.sampling.keys(len(req.ids)), sb.eos
    budgets = request_budgets(req, budgets)
    used = min(max_batch, len(ids))
    p = sb.prompt.shape[1]
    params = (target.params, head.params)
    t0 = time.perf_counter()
    state = committed(empty_slots(shape, *params, bucket(used, 1), p, eos, args), params)
    rows, admissions, run = serve_loop(
        SlotBook(len(ids), bucket(used, 1), used), state,
        admit=lambda st, batch, where, i: admit(*params, st, admission(ids, batch, where, prompt_len=p,
                                                                       max_new=budgets, keys=keys), eos, args),
        advance=lambda st, free: advance(*params, st, free, eos, args),
        rows=lambda st: {"done": st.state.done, "tokens": st.state.tokens[:, :sb.num_new],
                         **{k: getattr(st.state, k) for k in OUTPUTS[1:]}, "side": st.state.side},
        warm=(admit, p))
    out = tuple(np.int64(run["rounds"]) + admissions if key == "rounds" else np.stack([r[key] for r in rows])
                for key in OUTPUTS)
    res = spec_result(target, ids, out, time.perf_counter() - t0, gamma)
    res.stats.update(slots=used, admissions=admissions, **served_passes(res.stats, len(ids)),
                     **tree_stats(eagle, sum(r["side"] for r in rows)))
    return res
