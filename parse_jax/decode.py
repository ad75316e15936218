"""Target-only generation as one jitted program: prefill, then `lax.while_loop` over a dataclass state.

No Python runs per token. Shapes are padded to buckets (batch, prompt length, new tokens) so a long
run compiles a bounded number of programs; `compiled_programs()` says how many.
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
from parse_jax.sampling import prng_key, sample_token

PAD_ID = 0


def bucket(n: int, minimum: int = 8) -> int:
    """Next power of two >= max(n, minimum): the padding buckets of every static shape."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def length_bucket(n: int, minimum: int = 8) -> int:
    """Next of 2^k and 3 * 2^(k-1) >= max(n, minimum): the buckets of sequence lengths (blocks, caches). Two
    sizes per octave bound padding to a third of a pass instead of half, at twice the programs of `bucket`
    (on CPU a 42-token verification block padded to 64 cost 50% more than one padded to 48)."""
    n = max(int(n), minimum)
    power = bucket(n, 1)
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


@struct.dataclass
class DecodeState:
    cache: KVCache
    tokens: jax.Array      # [B, N] generated ids (PAD_ID after a row is done)
    num_new: jax.Array     # [B] tokens generated so far
    done: jax.Array        # [B] row finished (EOS or its max_new_tokens)
    last: jax.Array        # [B] last generated token: the next step's input
    step: jax.Array        # scalar: loop iteration


@dataclasses.dataclass
class GenerateResult:
    texts: list[str]
    tokens: list[list[int]]
    stats: dict


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise InputError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must lie in (0, 1], got {self.top_p}")

    def loop_args(self) -> tuple[np.float32, np.float32]:
        """(temperature, top_p) as a sampling program takes them (traced, so one program serves every value);
        temperature is floored away from 0, where greedy programs ignore it."""
        return np.float32(max(self.temperature, 1e-6)), np.float32(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_eos(token: jax.Array, eos_ids: jax.Array) -> jax.Array:
    return jnp.any(token[:, None] == eos_ids[None, :], axis=-1)


def decode_loop(forward, cache: KVCache, first_logits: jax.Array, max_new: jax.Array, eos_ids: jax.Array,
                rng: jax.Array, num_new: int, greedy: bool, temperature, top_k: int, top_p) -> DecodeState:
    """Sample from `first_logits`, then one-token steps through `cache` until every row is done.

    `forward(tokens, positions, cache, limit, group) -> (logits, cache)`. Traced inside the callers' jit:
    target-only generation after a prefill, and the target's continuation after a PARSE boundary.
    """
    b = first_logits.shape[0]

    def emit(state: DecodeState, step_logits: jax.Array) -> DecodeState:
        key = jax.random.fold_in(rng, state.step)
        tok = sample_token(step_logits, key, greedy, temperature, top_k, top_p)
        tok = jnp.where(state.done, PAD_ID, tok)
        tokens = state.tokens.at[:, state.step].set(tok)
        num = state.num_new + (~state.done).astype(jnp.int32)
        done = state.done | _is_eos(tok, eos_ids) | (num >= max_new)
        return state.replace(tokens=tokens, num_new=num, done=done, last=tok, step=state.step + 1)

    state = DecodeState(cache=cache, tokens=jnp.full((b, num_new), PAD_ID, jnp.int32),
                        num_new=jnp.zeros((b,), jnp.int32), done=max_new <= 0,
                        last=jnp.zeros((b,), jnp.int32), step=jnp.int32(0))
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


def to_host(x) -> np.ndarray:
    """A program's output as a numpy array on this host, gathered from every process when it is sharded across
    hosts (a multi-host mesh whose `data` axis spans processes); plain `np.asarray` otherwise."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


_PROGRAMS: list = []


def register_program(program):
    """Record a jitted program so that `compiled_programs` counts its compilations."""
    _PROGRAMS.append(program)
    return program


def forward_fn(module: Decoder, params, return_hidden: bool = False):
    """`(tokens, positions, cache, limit, group) -> (logits, cache)` of `module` with `params` (inside a jit);
    with `return_hidden`, `(logits, cache, hiddens)` (see `Decoder`)."""

    def forward(tokens, positions, cache, limit, group):
        logits, cache, hiddens = module.apply({"params": params}, tokens, positions, cache, limit, group,
                                              return_hidden)
        return (logits, cache, hiddens) if return_hidden else (logits, cache)

    return forward


@functools.cache
def _generate_program(cfg: ModelConfig, attention_impl: str, num_new: int, cache_len: int, greedy: bool,
                      top_k: int):
    module = Decoder(cfg, attention_impl)

    def run(params, prompt, prompt_lens, max_new, eos_ids, temperature, top_p, rng):
        b, p = prompt.shape
        forward = forward_fn(module, params)
        limit, group = causal_metadata(b, p)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        logits, cache = forward(prompt, positions, KVCache.init(cfg, b, cache_len), limit, group)
        cache = cache.commit(prompt_lens)
        last_logits = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
        state = decode_loop(forward, cache, last_logits, max_new, eos_ids, rng, num_new, greedy, temperature,
                            top_k, top_p)
        return state.tokens, state.num_new, state.step

    return register_program(jax.jit(run))


@functools.cache
def continue_program(cfg: ModelConfig, attention_impl: str, num_new: int, greedy: bool, top_k: int):
    """Jitted `(params, cache, first_logits, max_new, eos_ids, temperature, top_p, rng) -> DecodeState`;
    the cache (already holding the context) is donated."""
    module = Decoder(cfg, attention_impl)

    def run(params, cache, first_logits, max_new, eos_ids, temperature, top_p, rng):
        return decode_loop(forward_fn(module, params), cache, first_logits, max_new, eos_ids, rng, num_new,
                           greedy, temperature, top_k, top_p)

    return register_program(jax.jit(run, donate_argnums=(1,)))


def take_rows(tree, rows: jax.Array):
    """Rows `rows` of every array in `tree` (a cache, logits, ...): a smaller batch of the requests still running."""
    return jax.tree.map(lambda x: x[rows], tree)


take_rows = register_program(jax.jit(take_rows))


def compiled_programs() -> int:
    """Executables this process has compiled for generation, verification and speculation: every jitted program
    counts once per input-shape bucket it has run with (padding buckets keep this bounded)."""
    return sum(p._cache_size() for p in _PROGRAMS)


def encode_prompts(model, prompts: Sequence[str] | Sequence[Sequence[int]], add_bos: bool = True) -> list[list[int]]:
    """Text prompts through the tokenizer (BOS prepended when the tokenizer has one); id lists as given."""
    if isinstance(prompts, (str, bytes)):
        raise InputError("prompts must be a list of strings or of token-id lists, not a single string")
    if len(prompts) == 0:
        raise InputError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise InputError("text prompts need a tokenizer; this model has none (pass token ids)")
            ids = model.tokenizer.encode(p)
            if not ids:
                raise InputError(f"prompt {i} is empty (no tokens)")
            bos = getattr(model.tokenizer, "bos_id", None)
            if add_bos and bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise InputError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise InputError(f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def resolve_eos(model, eos_ids: Sequence[int] | None = None) -> np.ndarray:
    """Stop ids as an int32 array: `eos_ids` if given ([] = none), else the config's and tokenizer's EOS."""
    if eos_ids is None:
        tok_eos = getattr(model.tokenizer, "eos_id", None)
        eos_ids = [*model.config.eos_token_ids, *([tok_eos] if tok_eos is not None else [])]
    return np.array(sorted({int(x) for x in eos_ids}) or [-1], np.int32)


def pad_prompts(ids: list[list[int]], batch: int, length: int, max_new_tokens: int):
    """Right-padded prompts [batch, length], their lengths, and each row's budget (0 for padding rows)."""
    prompt = np.full((batch, length), PAD_ID, np.int32)
    lens = np.ones((batch,), np.int32)
    max_new = np.zeros((batch,), np.int32)
    for i, x in enumerate(ids):
        prompt[i, : len(x)] = x
        lens[i] = len(x)
        max_new[i] = max_new_tokens
    return prompt, lens, max_new


def generate(model, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 256,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             max_cache_len: int | None = None, add_bos: bool = True,
             eos_ids: Sequence[int] | None = None) -> GenerateResult:
    """Generate with the model alone, a batch of prompts of any lengths, per-row EOS and budget.

    `eos_ids` overrides the stop tokens (default: the config's and the tokenizer's EOS; [] = none).
    """
    sampling = SamplingParams(float(temperature), int(top_k), float(top_p), int(seed))
    if int(max_new_tokens) < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = encode_prompts(model, prompts, add_bos)
    cfg: ModelConfig = model.config
    capacity = int(max_cache_len) if max_cache_len is not None else cfg.max_position_embeddings
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > capacity:
            raise InputError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} cache slots but the cache holds {capacity}")
    b = bucket(len(ids), 1)
    p = bucket(max(len(x) for x in ids))
    n = bucket(max_new_tokens, 16)
    cache_len = min(length_bucket(p + n), capacity)
    prompt, lens, max_new = pad_prompts(ids, b, p, max_new_tokens)
    eos = resolve_eos(model, eos_ids)
    program = _generate_program(cfg, model.attention_impl, n, cache_len, sampling.greedy, sampling.top_k)
    mesh = getattr(model, "mesh", None)
    if mesh is not None:  # a sharded model (parse_jax.distributed): its requests go over the `data` axis
        from parse_jax.distributed import shard_rows

        prompt, lens, max_new = (shard_rows(x, mesh) for x in (prompt, lens, max_new))
    t0 = time.perf_counter()
    tokens, num_new, steps = program(model.params, prompt, lens, max_new, eos, *sampling.loop_args(),
                                     prng_key(sampling.seed))
    tokens, num_new = to_host(tokens), to_host(num_new)
    seconds = time.perf_counter() - t0
    out = [tokens[i, : num_new[i]].tolist() for i in range(len(ids))]
    texts = [model.tokenizer.decode(t) if model.tokenizer is not None else "" for t in out]
    total = int(num_new[: len(ids)].sum())
    stats = {"target_passes": int(steps), "new_tokens": total, "seconds": seconds,
             "tokens_per_s": total / seconds if seconds > 0 else float("inf"),
             "compiled_programs": compiled_programs()}
    return GenerateResult(texts=texts, tokens=out, stats=stats)
