"""The decoder's layer ops written on a param tree instead of as Flax modules: for code that runs the same params
outside `Decoder.apply` (the training forward, EAGLE-3's training-time-test unroll)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, scale, eps):
    return scale * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def linear(p, x):
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y
