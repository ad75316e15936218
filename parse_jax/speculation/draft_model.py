"""Token-level speculative decoding with a draft model, lossless, as one jitted program.

Each round the draft proposes `gamma` tokens, the target scores them in one pass and keeps the longest
run accepted by rejection sampling (Leviathan et al. 2023; Chen et al. 2023): token d_i is kept with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection a token is drawn from
norm(max(0, p_i - q_i)); when all are kept, a bonus token is drawn from p_{gamma+1}. At temperature 0
this is "keep while the draft equals the target's argmax", so the output is the target's greedy output.
Both caches hold the prompt and every emitted token but the last, which is the next round's input.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from parse_jax.errors import InputError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder, causal_metadata
from parse_jax.runtime.programs import bucket, committed, fetch, forward_fn, length_bucket, register_program
from parse_jax.runtime.requests import (
    PAD_ID,
    GenerateResult,
    GenerationStats,
    Request,
    SamplingParams,
    check_budgets,
    encode_prompts,
    pad_prompts,
    per_prompt,
    resolve_eos,
)
from parse_jax.runtime.sampling import Sampler, SamplingArgs, draw_rows, uniform_rows, unread_keys
from parse_jax.runtime.slots import Admission, SlotBook, admission, put_rows, request_budgets, serve_loop
from parse_jax.settings import SpecSettings, check_setting
from parse_jax.utils.validation import check_eos_ids, check_int, check_model


@struct.dataclass
class SpecState:
    target_cache: KVCache
    draft_cache: KVCache
    tokens: jax.Array     # [B, N + gamma + 1] emitted ids
    num_new: jax.Array    # [B]
    done: jax.Array       # [B]
    last: jax.Array       # [B] last emitted token, not yet in either cache
    rounds: jax.Array     # scalar: target verification passes so far
    accepted: jax.Array   # [B] draft tokens accepted in total
    proposed: jax.Array   # [B] draft tokens proposed in total
    drafts: jax.Array     # [B] verification passes the row was live in (num_drafts)
    per_pos: jax.Array    # [B, gamma] drafts whose token at each position was accepted
    max_new: jax.Array    # [B] the row's budget
    keys: jax.Array       # [B, 2] each row's key: its round r draws with `fold_in(key, r)` (r: its `drafts`)


def accept_proposals(p: jax.Array, q: jax.Array, props: jax.Array, sampler: Sampler, k_accept: jax.Array,
                     k_fix: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Lossless acceptance of `gamma` proposals: p [B, gamma + 1, V] target, q [B, gamma, V] drafter, props
    [B, gamma]; `k_accept`, `k_fix` [B, 2]: each row's keys. Returns (n_acc [B], emitted [B, gamma + 1]): the
    accepted proposals, then the correction (or the bonus token when all are kept) at index n_acc."""
    b, gamma = props.shape
    rows = jnp.arange(b)
    p_prop = jnp.take_along_axis(p[:, :gamma], props[..., None], -1)[..., 0]
    q_prop = jnp.take_along_axis(q, props[..., None], -1)[..., 0]
    if sampler.greedy:
        keep = p_prop > 0.5
    else:
        u = uniform_rows(k_accept, (gamma,))
        keep = u * q_prop < p_prop  # u < p/q without dividing by a zero q
    n_acc = jnp.argmin(jnp.concatenate([keep, jnp.zeros((b, 1), bool)], 1), axis=1)  # first rejection
    p_at = p[rows, n_acc]
    q_at = jnp.where((n_acc < gamma)[:, None], q[rows, jnp.minimum(n_acc, gamma - 1)], 0.0)
    residual = jnp.maximum(p_at - q_at, 0.0)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_at)
    if sampler.greedy:
        fix = jnp.argmax(residual, -1).astype(jnp.int32)
    else:
        fix = draw_rows(k_fix, jnp.log(residual))
    emitted = jnp.where(jnp.arange(gamma + 1)[None] < n_acc[:, None],
                        jnp.concatenate([props, props[:, :1]], 1), fix[:, None])
    return n_acc, emitted


def position_hits(n_acc: jax.Array, positions: int, live: jax.Array) -> jax.Array:
    """[B, positions]: 1 where a live row's draft token at that position was accepted (positions < n_acc)."""
    return (jnp.arange(positions)[None] < n_acc[:, None]).astype(jnp.int32) * live[:, None]


def emit_accepted(tokens: jax.Array, num_new: jax.Array, done: jax.Array, last: jax.Array, emitted: jax.Array,
                  n_acc: jax.Array, eos_ids: jax.Array, max_new: jax.Array):
    """Append each live row's emitted tokens (stopping at EOS and its budget) to `tokens` [B, width].
    Returns (tokens, num_new, done, last, commit): `commit` = tokens that enter the caches (last + accepted)."""
    b, width = tokens.shape
    n = emitted.shape[1]
    rows = jnp.arange(b)
    n_emit = n_acc + 1
    is_eos = jnp.any(emitted[..., None] == eos_ids[None, None, :], -1) & (jnp.arange(n)[None] < n_emit[:, None])
    eos_at = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1) + 1, n + 1)
    count = jnp.minimum(jnp.minimum(n_emit, eos_at), max_new - num_new)
    count = jnp.where(done, 0, count)
    slots = num_new[:, None] + jnp.arange(n)[None]
    slots = jnp.where(jnp.arange(n)[None] < count[:, None], slots, width)  # dropped
    tokens = tokens.at[rows[:, None], slots].set(emitted, mode="drop")
    num = num_new + count
    live = (~done).astype(jnp.int32)
    new_done = done | (eos_at <= n_emit) | (num >= max_new)
    new_last = jnp.where(done, last, emitted[rows, n_acc])
    return tokens, num, new_done, new_last, n_emit * live


@dataclasses.dataclass(frozen=True)
class SpecShape:
    """The static side of a speculation program: both models, gamma, the new-token bucket, the caches' length."""

    target: ModelConfig
    draft: ModelConfig
    impl: str
    gamma: int
    num_new: int
    cache_len: int
    sampler: Sampler


def spec_start(shape: SpecShape, target_fwd, draft_fwd, prompt, prompt_lens, max_new, eos_ids,
               args: SamplingArgs) -> SpecState:
    """Both prefills and the first token (each row's key folded with 2**31 - 1; its rounds fold theirs): the state
    a speculation loop starts from."""
    b, p = prompt.shape
    rows = jnp.arange(b)
    limit, group = causal_metadata(b, p)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    t_logits, t_cache = target_fwd(prompt, positions, KVCache.init(shape.target, b, shape.cache_len), limit, group)
    _, d_cache = draft_fwd(prompt, positions, KVCache.init(shape.draft, b, shape.cache_len), limit, group)
    first = shape.sampler.sample(t_logits[rows, prompt_lens - 1], args.fold(2**31 - 1))
    done = (max_new <= 0) | jnp.any(first[:, None] == eos_ids[None, :], -1) | (max_new <= 1)
    width = shape.num_new + shape.gamma + 1
    tokens = jnp.full((b, width), PAD_ID, jnp.int32).at[:, 0].set(jnp.where(max_new > 0, first, PAD_ID))
    zeros = jnp.zeros((b,), jnp.int32)
    return SpecState(target_cache=t_cache.commit(prompt_lens), draft_cache=d_cache.commit(prompt_lens),
                     tokens=tokens, num_new=jnp.minimum(max_new, 1), done=done, last=first, rounds=jnp.int32(1),
                     accepted=zeros, proposed=zeros, drafts=zeros, per_pos=jnp.zeros((b, shape.gamma), jnp.int32),
                     max_new=max_new, keys=args.key)


def spec_round(shape: SpecShape, target_fwd, draft_fwd, state: SpecState, eos_ids, args: SamplingArgs) -> SpecState:
    """One speculation round on every row: gamma draft steps, one target pass over them, lossless acceptance."""
    gamma, sampler = shape.gamma, shape.sampler
    b = state.done.shape[0]
    a_draft, a_accept, a_fix = args.with_keys(state.keys).fold(state.drafts).split(3)  # the row's own round
    one_limit, one_group = causal_metadata(b, 1)

    def step(carry, i):  # gamma + 1 draft steps: propose gamma tokens, and write the last proposal's KV too
        cache, tok = carry
        logits, cache = draft_fwd(tok[:, None], cache.lengths[:, None], cache, one_limit, one_group)
        cache = cache.commit(1)
        q = sampler.probs(logits[:, 0], args)
        nxt = sampler.sample(logits[:, 0], a_draft.fold(i))
        return (cache, nxt), (nxt, q)

    (d_cache, _), (props, qs) = jax.lax.scan(step, (state.draft_cache, state.last), jnp.arange(gamma + 1))
    props, q = props[:gamma].T, jnp.swapaxes(qs[:gamma], 0, 1)  # [B, gamma], [B, gamma, V]
    block = jnp.concatenate([state.last[:, None], props], axis=1)  # [B, gamma + 1]
    blk_limit, blk_group = causal_metadata(b, gamma + 1)
    pos = state.target_cache.lengths[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
    logits, t_cache = target_fwd(block, pos, state.target_cache, blk_limit, blk_group)
    p = sampler.probs(logits, args)  # [B, gamma + 1, V]
    n_acc, emitted = accept_proposals(p, q, props, sampler, a_accept.key, a_fix.key)
    tokens, num, done, last, commit = emit_accepted(state.tokens, state.num_new, state.done, state.last,
                                                    emitted, n_acc, eos_ids, state.max_new)
    live = (~state.done).astype(jnp.int32)
    return state.replace(
        target_cache=t_cache.commit(commit),
        draft_cache=d_cache.set_lengths(state.draft_cache.lengths + commit),
        tokens=tokens, num_new=num, done=done, last=last, rounds=state.rounds + 1,
        accepted=state.accepted + n_acc * live, proposed=state.proposed + gamma * live,
        drafts=state.drafts + live, per_pos=state.per_pos + position_hits(n_acc, gamma, live))


def spec_outputs(state: SpecState, num_new: int) -> tuple:
    """What `spec_result` reads: (tokens, num_new, rounds, accepted, proposed, drafts, per_pos)."""
    return (state.tokens[:, :num_new], state.num_new, state.rounds, state.accepted, state.proposed, state.drafts,
            state.per_pos)


def _forwards(shape: SpecShape, target_params, draft_params):
    return (forward_fn(Decoder(shape.target, shape.impl), target_params),
            forward_fn(Decoder(shape.draft, shape.impl), draft_params))


@functools.cache
def _spec_program(shape: SpecShape):
    def run(target_params, draft_params, prompt, prompt_lens, max_new, eos_ids, args: SamplingArgs):
        target_fwd, draft_fwd = _forwards(shape, target_params, draft_params)
        state = spec_start(shape, target_fwd, draft_fwd, prompt, prompt_lens, max_new, eos_ids, args)
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                                   lambda s: spec_round(shape, target_fwd, draft_fwd, s, eos_ids, args), state)
        return spec_outputs(state, shape.num_new)

    return register_program(jax.jit(run))


@functools.cache
def spec_serve_programs(shape: SpecShape):
    """(admit, advance) of speculative decoding by continuous batching (`runtime/slots.serve_loop`): admit prefills
    up to k prompts and writes their rows into the slots named; advance runs rounds on every slot until enough
    are free. The slot state is donated to both."""

    def admit(target_params, draft_params, state: SpecState, adm: Admission, eos_ids, args: SamplingArgs):
        target_fwd, draft_fwd = _forwards(shape, target_params, draft_params)
        rows = spec_start(shape, target_fwd, draft_fwd, adm.prompt, adm.lens, adm.max_new, eos_ids,
                          args.with_keys(adm.keys))
        return put_rows(state, rows, adm.slots)

    def advance(target_params, draft_params, state: SpecState, free_target, eos_ids, args: SamplingArgs):
        target_fwd, draft_fwd = _forwards(shape, target_params, draft_params)
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (jnp.sum(s.done) < free_target),
                                  lambda s: spec_round(shape, target_fwd, draft_fwd, s, eos_ids, args), state)

    return (register_program(jax.jit(admit, donate_argnums=(2,))),
            register_program(jax.jit(advance, donate_argnums=(2,))))


def empty_spec_state(shape: SpecShape, slots: int) -> SpecState:
    """Every slot empty (done), its caches allocated for the run (each leaf its own buffer: the state is donated)."""
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731
    return SpecState(target_cache=KVCache.init(shape.target, slots, shape.cache_len),
                     draft_cache=KVCache.init(shape.draft, slots, shape.cache_len),
                     tokens=jnp.full((slots, shape.num_new + shape.gamma + 1), PAD_ID, jnp.int32), num_new=zeros(),
                     done=jnp.ones((slots,), bool), last=zeros(), rounds=jnp.int32(0), accepted=zeros(),
                     proposed=zeros(), drafts=zeros(), per_pos=jnp.zeros((slots, shape.gamma), jnp.int32),
                     max_new=zeros(), keys=jnp.asarray(unread_keys(slots)))


def serve_speculation(target, draft, req: Request, *, gamma: int, max_batch: int,
                      budgets: list[int] | None = None) -> GenerateResult:
    """Speculative decoding of a validated request by continuous batching through `max_batch` slots: greedy
    outputs equal each prompt alone (a row reads only its own cache rows). `budgets`: each prompt's own
    max_new_tokens, at most the request's (default: the request's)."""
    capacity = min(target.config.max_position_embeddings, draft.config.max_position_embeddings)
    sb = spec_batch(target, req, gamma=gamma, capacity=capacity)
    shape = SpecShape(target.config, draft.config, target.attention_impl, int(gamma), sb.num_new, sb.cache_len,
                      sb.sampling.sampler)
    admit, advance = spec_serve_programs(shape)
    ids, args, keys, eos = req.ids, sb.sampling.args(1), sb.sampling.keys(len(req.ids)), sb.eos
    used = min(max_batch, len(ids))
    slots = bucket(used, 1)
    p = sb.prompt.shape[1]
    budgets = request_budgets(req, budgets)
    t0 = time.perf_counter()
    rows, admissions, run = serve_loop(
        SlotBook(len(ids), slots, used), committed(empty_spec_state(shape, slots), (target.params, draft.params)),
        admit=lambda st, batch, where, i: admit(target.params, draft.params, st,
                                                admission(ids, batch, where, prompt_len=p, max_new=budgets, keys=keys),
                                                eos, args),
        advance=lambda st, free: advance(target.params, draft.params, st, free, eos, args),
        rows=lambda st: {"done": st.done, **dict(zip(SPEC_OUTPUTS, spec_outputs(st, shape.num_new)))},
        warm=(admit, p))
    out = tuple(np.int64(run["rounds"]) + admissions if key == "rounds" else np.stack([r[key] for r in rows])
                for key in SPEC_OUTPUTS)
    res = spec_result(target, ids, out, time.perf_counter() - t0, gamma)
    res.stats.update(slots=used, admissions=admissions, **served_passes(res.stats, len(ids)))
    return res


def served_passes(stats: dict, requests: int) -> dict[str, int]:
    """A served token-level run's passes per request, summed: each request's prefill and the passes that verified
    its drafts (what a batch of one counts), each a check of drafted tokens as in a fixed batch's count."""
    passes = requests + int(stats["num_drafts"])
    return {"request_passes": passes, "request_checks": passes}


SPEC_OUTPUTS = ("tokens", "num_new", "rounds", "accepted", "proposed", "drafts", "per_pos")


def check_pair(target, draft) -> None:
    """A draft proposes target token ids: the vocabularies must agree."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise InputError(f"draft and target have different vocabularies ({draft.config.vocab_size} vs "
                         f"{target.config.vocab_size} tokens); token-level speculation needs the same one")


@dataclasses.dataclass
class SpecBatch:
    """Host inputs of one token-speculation program (draft model or EAGLE-3): prompts padded to buckets."""

    ids: list[list[int]]
    sampling: SamplingParams
    prompt: np.ndarray
    lens: np.ndarray
    max_new: np.ndarray
    eos: np.ndarray
    num_new: int       # the new-token bucket
    cache_len: int


def spec_batch(target, req: Request, *, gamma: int, capacity: int, extra_slots: int = 0) -> SpecBatch:
    """Checks and padding shared by speculative decoding and EAGLE-3. A round writes `gamma + 1` (+ `extra_slots`)
    tokens past the last emitted one, so each prompt needs that much cache beyond its budget."""
    if int(gamma) < 1:
        raise InputError(f"gamma (draft tokens per round) must be >= 1, got {gamma}")
    ids, max_new_tokens = req.ids, req.max_new
    margin = gamma + 1 + extra_slots
    extra = f" (+{extra_slots} tree slots)" if extra_slots else ""
    for i, (p, budget) in enumerate(zip(ids, req.budget_list())):  # the cache is capped at `capacity`
        if len(p) + budget + margin > capacity:
            raise InputError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={budget} and "
                             f"gamma={gamma}{extra} it needs {len(p) + budget + margin} cache slots but the "
                             f"cache holds {capacity}")
    b, p, n = bucket(len(ids), 1), bucket(max(len(x) for x in ids)), bucket(max_new_tokens, 16)
    prompt, lens, max_new = pad_prompts(ids, b, p, req.budget_list())
    return SpecBatch(ids, req.sampling, prompt, lens, max_new, req.eos, n,
                     min(length_bucket(p + n + margin), capacity))


def spec_request(target, prompts, max_new_tokens: int | Sequence[int], sampling: SamplingParams, add_bos: bool,
                 eos_ids: Sequence[int] | None) -> Request:
    """The request of a speculation entry point called directly (the engine validates its own)."""
    if not per_prompt(max_new_tokens):
        check_int("max_new_tokens", max_new_tokens, 1, error=InputError)  # before the prompts are encoded
    eos_ids = check_eos_ids(eos_ids, target.config.vocab_size)
    ids = encode_prompts(target, prompts, add_bos)
    sampling.check_prompts(len(ids))
    max_new, budgets = check_budgets(max_new_tokens, len(ids))
    return Request(ids=ids, max_new=max_new, sampling=sampling, eos=resolve_eos(target, eos_ids), budgets=budgets)


def spec_result(target, ids: list[list[int]], out, seconds: float, gamma: int) -> GenerateResult:
    """Texts, tokens and stats of a speculation program's fetched `(tokens, num_new, rounds, accepted, proposed,
    drafts, per_pos)`, the field's metrics among them (parse_jax/runtime/metrics.py)."""
    tokens, num_new, rounds, accepted, proposed, drafts, per_pos = out
    n = len(ids)
    toks = [tokens[i, : num_new[i]].tolist() for i in range(n)]
    texts = [target.tokenizer.decode(t) if target.tokenizer is not None else "" for t in toks]
    stats = GenerationStats(new_tokens=int(num_new[:n].sum()), seconds=seconds, target_passes=int(rounds),
                            draft_tokens=int(proposed[:n].sum()), accepted_tokens=int(accepted[:n].sum()),
                            accepted_per_request=[int(x) for x in accepted[:n]],
                            acceptance_rate=float(accepted[:n].sum() / max(proposed[:n].sum(), 1)), gamma=int(gamma),
                            num_drafts=int(drafts[:n].sum()), num_draft_tokens=int(proposed[:n].sum()),
                            num_accepted_tokens=int(accepted[:n].sum()),
                            num_accepted_tokens_per_pos=[int(x) for x in per_pos[:n].sum(0)],
                            drafts_per_request=[int(x) for x in drafts[:n]])
    return GenerateResult(texts=texts, tokens=toks, stats=stats.as_dict())


def spec_args(target, drafter_params, sb: SpecBatch) -> tuple:
    """The arguments of a speculation program (the draft model's or EAGLE-3's) for a prepared batch."""
    return target.params, drafter_params, sb.prompt, sb.lens, sb.max_new, sb.eos, sb.sampling.args(sb.prompt.shape[0])


def run_spec(target, program, drafter_params, sb: SpecBatch, gamma: int) -> GenerateResult:
    """Run a speculation program (`program(target_params, drafter_params, prompt, lens, max_new, eos, args)`: the
    draft model's or EAGLE-3's) on a prepared batch, timed, and collect its result."""
    t0 = time.perf_counter()
    out = program(*spec_args(target, drafter_params, sb))
    out = fetch(out)
    return spec_result(target, sb.ids, out, time.perf_counter() - t0, gamma)


def speculative_generate(target, draft, prompts: Sequence[str] | Sequence[Sequence[int]], *, gamma: int = 4,
                         max_new_tokens: int | Sequence[int] = 256, temperature: float = 0.0, top_k: int = 0,
                         top_p: float = 1.0, seed: int | Sequence[int] = 0, max_cache_len: int | None = None,
                         add_bos: bool = True, eos_ids: Sequence[int] | None = None) -> GenerateResult:
    """Lossless speculative decoding: same output distribution as `generate(target, ...)`."""
    check_model("target", target, error=InputError)
    check_model("draft", draft, error=InputError)
    check_pair(target, draft)
    gamma = check_setting(SpecSettings, "gamma", gamma, error=InputError)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    req = spec_request(target, prompts, max_new_tokens, sampling, add_bos, eos_ids)
    capacity = check_int("max_cache_len", max_cache_len, 1, error=InputError) if max_cache_len is not None else None
    return speculate(target, draft, req, gamma=gamma, capacity=capacity)


def speculate(target, draft, req: Request, *, gamma: int, capacity: int | None = None) -> GenerateResult:
    """Speculative decoding of a validated request (mode `sd`); `capacity`: the cache slots (default: the models'
    positions)."""
    program, sb = speculate_launch(target, draft, req, gamma=gamma, capacity=capacity)
    return run_spec(target, program, draft.params, sb, gamma)


def speculate_launch(target, draft, req: Request, *, gamma: int, capacity: int | None = None):
    """(program, prepared batch) of speculative decoding for `req`, not run (`spec_args` gives its arguments)."""
    if capacity is None:
        capacity = min(target.config.max_position_embeddings, draft.config.max_position_embeddings)
    sb = spec_batch(target, req, gamma=gamma, capacity=capacity)
    program = _spec_program(SpecShape(target.config, draft.config, target.attention_impl, int(gamma), sb.num_new,
                                      sb.cache_len, sb.sampling.sampler))
    return program, sb
