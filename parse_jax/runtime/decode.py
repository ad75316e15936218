"""Target-only generation as one jitted program: prefill, then `lax.while_loop` over a dataclass state.

No Python runs per token. Shapes are padded to buckets (batch, prompt length, new tokens) so a long
run compiles a bounded number of programs; `compiled_programs()` says how many.
"""

from __future__ import annotations

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
from parse_jax.runtime.programs import bucket, compiled_programs, fetch, forward_fn, length_bucket, register_program
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
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.utils.validation import check_eos_ids, check_int, check_model


@struct.dataclass
class DecodeState:
    cache: KVCache
    tokens: jax.Array      # [B, N] generated ids (PAD_ID after a row is done)
    num_new: jax.Array     # [B] tokens generated so far
    done: jax.Array        # [B] row finished (EOS or its max_new_tokens)
    last: jax.Array        # [B] last generated token: the next step's input
    step: jax.Array        # scalar: loop iteration
    probs: jax.Array | None = None  # [B, N] each token's probability under the sampled distribution (keep_probs)


def is_eos(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """Which tokens (any shape) are stop ids."""
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def decode_loop(forward, cache: KVCache, first_logits: jax.Array, *, max_new: jax.Array, eos_ids: jax.Array,
                sampler: Sampler, args: SamplingArgs, num_new: int) -> DecodeState:
    """Sample from `first_logits`, then one-token steps through `cache` until every row is done (step i draws with
    `args.fold(i)`). `sampler.keep_probs`: also keep each token's probability under the model's softmax (PARSE's
    confidence-chosen prefixes read the draft's).

    `forward(tokens, positions, cache, limit, group) -> (logits, cache)`. Traced inside the callers' jit:
    target-only generation after a prefill, the draft's answer, and the target's continuation after a PARSE boundary.
    """
    b = first_logits.shape[0]
    keep_probs = sampler.keep_probs

    def emit(state: DecodeState, step_logits: jax.Array) -> DecodeState:
        tok = sampler.sample(step_logits, args.fold(state.step))
        tok = jnp.where(state.done, PAD_ID, tok)
        tokens = state.tokens.at[:, state.step].set(tok)
        num = state.num_new + (~state.done).astype(jnp.int32)
        done = state.done | is_eos(tok, eos_ids) | (num >= max_new)
        probs = state.probs
        if keep_probs:
            logp = jax.nn.log_softmax(step_logits.astype(jnp.float32), axis=-1)
            p = jnp.exp(jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0])
            probs = probs.at[:, state.step].set(jnp.where(state.done, 1.0, p))
        return state.replace(tokens=tokens, num_new=num, done=done, last=tok, step=state.step + 1, probs=probs)

    state = DecodeState(cache=cache, tokens=jnp.full((b, num_new), PAD_ID, jnp.int32),
                        num_new=jnp.zeros((b,), jnp.int32), done=max_new <= 0,
                        last=jnp.zeros((b,), jnp.int32), step=jnp.int32(0),
                        probs=jnp.ones((b, num_new), jnp.float32) if keep_probs else None)
    state = emit(state, first_logits)

    def cond(state: DecodeState) -> jax.Array:
        return (state.step < num_new) & ~jnp.all(state.done)

    def body(state: DecodeState) -> DecodeState:
        one_limit, one_group = causal_metadata(b, 1)
        step_logits, cache = forward(state.last[:, None], state.cache.lengths[:, None], state.cache,
                                     one_limit, one_group)
        cache = cache.commit((~state.done).astype(jnp.int32))
        return emit(state.replace(cache=cache), step_logits[:, 0])

    return jax.lax.while_loop(cond, body, state)


def prefill(forward, cfg: ModelConfig, prompt: jax.Array, prompt_lens: jax.Array, cache_len: int):
    """(cache holding each row's prompt, the logits after its last token): one causal pass over the padded
    prompts, inside the callers' jit."""
    b, p = prompt.shape
    limit, group = causal_metadata(b, p)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache = forward(prompt, positions, KVCache.init(cfg, b, cache_len), limit, group)
    last_logits = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    return cache.commit(prompt_lens), last_logits


@functools.cache
def _generate_program(cfg: ModelConfig, attention_impl: str, num_new: int, cache_len: int, sampler: Sampler):
    module = Decoder(cfg, attention_impl)

    def run(params, prompt, prompt_lens, max_new, eos_ids, args: SamplingArgs):
        forward = forward_fn(module, params)
        cache, first_logits = prefill(forward, cfg, prompt, prompt_lens, cache_len)
        state = decode_loop(forward, cache, first_logits, max_new=max_new, eos_ids=eos_ids, sampler=sampler,
                            args=args, num_new=num_new)
        return state.tokens, state.num_new, state.step

    return register_program(jax.jit(run))


@functools.cache
def continue_program(cfg: ModelConfig, attention_impl: str, num_new: int, sampler: Sampler):
    """Jitted `(params, cache, first_logits, max_new, eos_ids, args) -> DecodeState`; the cache (already holding
    the context) is donated."""
    module = Decoder(cfg, attention_impl)

    def run(params, cache, first_logits, max_new, eos_ids, args: SamplingArgs):
        return decode_loop(forward_fn(module, params), cache, first_logits, max_new=max_new, eos_ids=eos_ids,
                           sampler=sampler, args=args, num_new=num_new)

    return register_program(jax.jit(run, donate_argnums=(1,)))


def check_capacity(ids: list[list[int]], max_new_tokens: int | Sequence[int], capacity: int) -> None:
    """Every prompt with its `max_new_tokens` (one for all, or each its own) fits `capacity` cache slots."""
    budgets = [max_new_tokens] * len(ids) if np.ndim(max_new_tokens) == 0 else max_new_tokens
    for i, (p, budget) in enumerate(zip(ids, budgets)):
        if len(p) + budget > capacity:
            raise InputError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={budget} it needs "
                f"{len(p) + budget} cache slots but the cache holds {capacity}")


def generate_cache_len(ids: list[list[int]], max_new_tokens: int, capacity: int) -> int:
    """The cache slots of `generate_launch`'s program for these prompts and budget."""
    return min(length_bucket(bucket(max(len(x) for x in ids)) + bucket(max_new_tokens, 16)), capacity)


def generate_launch(model, ids: list[list[int]], budgets: int | Sequence[int], sampling: SamplingParams,
                    eos: np.ndarray, capacity: int):
    """(program, args) of target-only generation for prompts already as ids (checked against `capacity`), with
    `budgets` new tokens at most (one for every prompt, or each its own)."""
    cfg: ModelConfig = model.config
    max_new_tokens = int(np.max(budgets))  # what the shapes are made for (the cache capped at `capacity`)
    check_capacity(ids, budgets, capacity)
    b = bucket(len(ids), 1)
    p = bucket(max(len(x) for x in ids))
    n = bucket(max_new_tokens, 16)
    cache_len = generate_cache_len(ids, max_new_tokens, capacity)
    prompt, lens, max_new = pad_prompts(ids, b, p, budgets)
    program = _generate_program(cfg, model.attention_impl, n, cache_len, sampling.sampler)
    prompt, lens, max_new = (model.place_rows(x) for x in (prompt, lens, max_new))  # sharded: over `data`
    return program, (model.params, prompt, lens, max_new, eos, sampling.args(b))


def target_request(model, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   sampling: SamplingParams, *, eos_ids: Sequence[int] | None = None, add_bos: bool = True,
                   capacity: int | None = None) -> Request:
    """A validated request of target-only generation (every check of `generate`, before anything runs): the
    budget, the stop ids inside the vocabulary, the prompts as ids, each fitting `capacity` (default: the model's
    positions)."""
    if not per_prompt(max_new_tokens):
        check_int("max_new_tokens", max_new_tokens, 1, error=InputError)  # before the prompts are encoded
    eos_ids = check_eos_ids(eos_ids, model.config.vocab_size)
    ids = encode_prompts(model, prompts, add_bos)
    sampling.check_prompts(len(ids))
    max_new, budgets = check_budgets(max_new_tokens, len(ids))
    check_capacity(ids, max_new if budgets is None else budgets,
                   model.config.max_position_embeddings if capacity is None else capacity)
    return Request(ids=ids, max_new=max_new, sampling=sampling, eos=resolve_eos(model, eos_ids), budgets=budgets)


def generate(model, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 256,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | Sequence[int] = 0,
             max_cache_len: int | None = None, add_bos: bool = True,
             eos_ids: Sequence[int] | None = None) -> GenerateResult:
    """Generate with the model alone, a batch of prompts of any lengths, per-row EOS and budget.

    `eos_ids` overrides the stop tokens (default: the config's and the tokenizer's EOS; [] = none). `seed`: prompt i
    draws from `seed + i`, or one seed per prompt. `max_new_tokens`: one budget, or one per prompt.
    """
    check_model("model", model, error=InputError)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    capacity = (model.config.max_position_embeddings if max_cache_len is None
                else check_int("max_cache_len", max_cache_len, 1, error=InputError))
    req = target_request(model, prompts, max_new_tokens, sampling, eos_ids=eos_ids, add_bos=add_bos,
                         capacity=capacity)
    return run_request(model, req, capacity)


def run_request(model, req: Request, capacity: int | None = None) -> GenerateResult:
    """Target-only generation of a validated request (`target_request`, `ParseEngine.request`): its stop ids as
    resolved (an empty set is the sentinel id -1), nothing checked again."""
    capacity = model.config.max_position_embeddings if capacity is None else capacity
    ids = req.ids
    program, args = generate_launch(model, ids, req.budget_list(), req.sampling, req.eos, capacity)
    t0 = time.perf_counter()
    tokens, num_new, steps = fetch(program(*args))
    seconds = time.perf_counter() - t0
    out = [tokens[i, : num_new[i]].tolist() for i in range(len(ids))]
    texts = [model.tokenizer.decode(t) if model.tokenizer is not None else "" for t in out]
    stats = GenerationStats(new_tokens=int(num_new[: len(ids)].sum()), seconds=seconds, target_passes=int(steps))
    return GenerateResult(texts=texts, tokens=out, stats={**stats.as_dict(), "compiled_programs": compiled_programs()})
