"""Next-token sampling from logits: greedy, temperature, top-k, top-p. Pure and jittable. A program takes sampling as
two objects: a static `Sampler` (greedy, top_k) and a traced `SamplingArgs` (temperature, top_p, one key per row).

Every row draws from its own key, folded only with the row's own counters (its step, its round, its output length):
a prompt's draws never depend on the other prompts of its batch, its batch size or its slot (as vLLM's per-request
seeds), so a sampled run gives each prompt what it gets alone (docs/design.md §3)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def filter_logits(logits: jax.Array, temperature: jax.Array | float, top_k: int = 0,
                  top_p: jax.Array | float = 1.0) -> jax.Array:
    """Tempered logits [..., V] with tokens outside top-k / the top-p nucleus set to -inf.

    `top_k` is static (0 = off); `temperature` (> 0) and `top_p` (in (0, 1]) may be traced.
    The most likely token always survives, so a row is never all -inf.
    """
    logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a sorted token while the mass strictly before it is below top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < jnp.asarray(top_p, jnp.float32)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def sample_token(logits: jax.Array, keys: jax.Array, greedy: bool, temperature: jax.Array | float = 1.0,
                 top_k: int = 0, top_p: jax.Array | float = 1.0) -> jax.Array:
    """int32 token per row of logits [B, ..., V], row b drawn with `keys[b]`; `greedy` (static) is argmax."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draw_rows(keys, filter_logits(logits, temperature, top_k, top_p))


def draw_rows(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """A categorical draw per row of `logits` [B, ..., V] (log-probabilities up to a constant), row b with `keys[b]`
    alone: a row's draw does not depend on the others."""
    return jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(keys, logits).astype(jnp.int32)


def uniform_rows(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform [0, 1) draws [B, *shape], row b with `keys[b]` alone."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)


def prng_key(seed: int) -> jax.Array:
    """The PRNG key of `seed` (jax's default implementation), cached: building one costs about as much host time
    as a whole draft decode."""
    return _prng_key(seed, jax.config.jax_default_prng_impl)


def unread_keys(rows: int) -> np.ndarray:
    """[rows, key width] zero keys: a greedy run's (never read) and an empty slot's (its row's come at admission)."""
    return np.zeros((rows, *prng_key(0).shape), np.uint32)


@functools.lru_cache(maxsize=4096)
def _prng_key(seed: int, impl: str) -> jax.Array:
    return jax.random.PRNGKey(seed)


def row_keys(seeds: Sequence[int]) -> np.ndarray:
    """[len(seeds), 2] each seed's `jax.random.PRNGKey`, built on the host with no program (a served run picks its
    admissions' rows from them for free, and a call compiles nothing for its number of prompts): threefry's key of a
    seed below 2**32 is [0, seed]; another PRNG implementation's, each seed's cached key."""
    if jax.config.jax_default_prng_impl == "threefry2x32":
        keys = np.zeros((len(seeds), 2), np.uint32)
        keys[:, 1] = np.asarray(seeds, np.int64)
        return keys
    return np.stack([np.asarray(prng_key(int(s))) for s in seeds]).astype(np.uint32)


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The static half of sampling (a jit static argument: one program per value): greedy argmax, or a draw with
    top-k filtering (`top_k` 0 = off). The traced half, `SamplingArgs`, travels beside it."""

    greedy: bool
    top_k: int = 0
    keep_probs: bool = False  # also keep each sampled token's probability (`decode_loop`; a PARSE draft's confidence)

    def sample(self, logits: jax.Array, args: SamplingArgs) -> jax.Array:
        """int32 token per row of logits [B, ..., V], row b drawn with `args.key[b]`."""
        return sample_token(logits, args.key, self.greedy, args.temperature, self.top_k, args.top_p)

    def probs(self, logits: jax.Array, args: SamplingArgs) -> jax.Array:
        """The distribution a token is drawn from: one-hot argmax when greedy, else the filtered softmax."""
        if self.greedy:
            return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
        return jax.nn.softmax(filter_logits(logits, args.temperature, self.top_k, args.top_p), axis=-1)


@struct.dataclass
class SamplingArgs:
    """The traced half of sampling (changing them never compiles again): temperature (> 0; greedy programs ignore
    it), top_p and each row's PRNG key, which its draws derive from."""

    temperature: jax.Array   # float32 scalar
    top_p: jax.Array         # float32 scalar
    key: jax.Array           # [B, 2] uint32: each row's own key (raw key data)

    def fold(self, data) -> SamplingArgs:
        """The same settings with each row's key `fold_in(key[b], data[b])`: `data` a scalar (every row's step or
        round in a batch that runs them together) or [B] (each row's own counter)."""
        data = jnp.broadcast_to(jnp.asarray(data).astype(jnp.uint32), self.key.shape[:1])
        return self.replace(key=jax.vmap(jax.random.fold_in)(self.key, data))

    def split(self, num: int) -> tuple[SamplingArgs, ...]:
        """`num` copies whose row keys are those of `jax.random.split(key[b], num)`."""
        keys = jax.vmap(lambda k: jax.random.split(k, num))(self.key)
        return tuple(self.replace(key=keys[:, i]) for i in range(num))

    def with_keys(self, keys: jax.Array) -> SamplingArgs:
        """The same settings with other rows' keys (an admission's, a slot state's)."""
        return self.replace(key=keys)
