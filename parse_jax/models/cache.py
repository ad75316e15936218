"""The KV cache: fixed-size buffers plus a per-row committed length.

A forward pass writes its block at slots `lengths[b] + j` without moving `lengths`; the caller then
commits what it keeps (`commit`) or leaves the rest to be overwritten (roll back = keep the old length).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from parse_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, kv_heads, S, head_dim]; a tuple so each layer updates in place
    v: tuple[jax.Array, ...]
    lengths: jax.Array        # [B] int32: slots below this are committed context

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
        dtype = dtype or jnp.dtype(cfg.dtype)
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        layers = range(cfg.num_layers)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def commit(self, n: jax.Array | int) -> KVCache:
        """Keep the first `n` (per row, or scalar) tokens of the block last written."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def set_lengths(self, lengths: jax.Array) -> KVCache:
        """Roll back (or forward) to explicit per-row lengths; slots past them become invisible."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def padded(self, max_len: int) -> KVCache:
        """The same cache in buffers of `max_len` slots (empty past the old end): a program whose first phase
        needs fewer slots than its later ones runs that phase over the smaller buffers."""
        pad = ((0, 0), (0, 0), (0, max_len - self.max_len), (0, 0))
        return self.replace(k=tuple(jnp.pad(x, pad) for x in self.k), v=tuple(jnp.pad(x, pad) for x in self.v))


def write_block(buf: jax.Array, block: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write block [B, T, KV, D] into buf [B, KV, S, D] at slots lengths[b] + j; slots past S are dropped (never
    clamped back onto written slots: multi-round caches are sized for real tokens only, and a block's padding may
    fall past S, modes/parse_multi.multi_shape).

    Heads before slots: per (row, head) the keys are one contiguous [S, D] matrix, so attention over the
    cache is a plain batched matmul with no transpose of the cache (on CPU that transpose cost more than
    the rest of the model).
    """
    b, t = block.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    slots = lengths[:, None] + jnp.arange(t)[None, :]
    return buf.at[rows, :, slots].set(block.astype(buf.dtype), mode="drop")
