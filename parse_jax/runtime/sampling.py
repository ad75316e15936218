"""Next-token sampling from logits: greedy, temperature, top-k, top-p. Pure and jittable. A program takes sampling as
two objects: a static `Sampler` (greedy, top_k) and a traced `SamplingArgs` (temperature, top_p, key)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
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


def sample_token(logits: jax.Array, rng: jax.Array, greedy: bool, temperature: jax.Array | float = 1.0,
                 top_k: int = 0, top_p: jax.Array | float = 1.0) -> jax.Array:
    """int32 token per row of logits [B, V]; `greedy` (static) is argmax."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=4096)
def prng_key(seed: int) -> jax.Array:
    """The PRNG key of `seed`, cached: building one costs about as much host time as a whole draft decode."""
    return jax.random.PRNGKey(seed)


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The static half of sampling (a jit static argument: one program per value): greedy argmax, or a draw with
    top-k filtering (`top_k` 0 = off). The traced half, `SamplingArgs`, travels beside it."""

    greedy: bool
    top_k: int = 0
    keep_probs: bool = False  # also keep each sampled token's probability (`decode_loop`; a PARSE draft's confidence)

    def sample(self, logits: jax.Array, args: SamplingArgs) -> jax.Array:
        """int32 token per row of logits [B, V], drawn with `args.key`."""
        return sample_token(logits, args.key, self.greedy, args.temperature, self.top_k, args.top_p)

    def probs(self, logits: jax.Array, args: SamplingArgs) -> jax.Array:
        """The distribution a token is drawn from: one-hot argmax when greedy, else the filtered softmax."""
        if self.greedy:
            return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
        return jax.nn.softmax(filter_logits(logits, args.temperature, self.top_k, args.top_p), axis=-1)


@struct.dataclass
class SamplingArgs:
    """The traced half of sampling (changing them never compiles again): temperature (> 0; greedy programs ignore
    it), top_p and the PRNG key the draws derive from."""

    temperature: jax.Array   # float32 scalar
    top_p: jax.Array         # float32 scalar
    key: jax.Array           # PRNG key

    def fold(self, data) -> SamplingArgs:
        """The same settings with the key `fold_in(key, data)` (a step's or a round's own key)."""
        return self.replace(key=jax.random.fold_in(self.key, data))

    def split(self, num: int) -> tuple[SamplingArgs, ...]:
        """`num` copies with the keys of `jax.random.split(key, num)`."""
        return tuple(self.replace(key=k) for k in jax.random.split(self.key, num))
