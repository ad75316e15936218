"""Next-token sampling from logits: greedy, temperature, top-k, top-p. Pure and jittable."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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
