"""KV cache writes (models/cache.py)."""

import jax.numpy as jnp

from parse_jax.models.cache import write_block


def test_a_cache_write_drops_what_falls_past_the_buffer_and_keeps_what_was_written():
    """Multi-round caches are sized for real tokens only (`multi_shape`): a block's padding may fall past the
    buffer, and must be dropped there, not clamped back onto written slots."""
    buf = jnp.zeros((1, 1, 6, 1)).at[0, 0, :4, 0].set(jnp.arange(1.0, 5.0))  # slots 0-3 written
    block = jnp.full((1, 4, 1, 1), 9.0)  # 4 slots from slot 4: two fit, two fall past the end
    out = write_block(buf, block, jnp.array([4]))
    assert out[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 9.0, 9.0]


def test_a_padded_cache_keeps_its_entries_and_lengths_and_adds_empty_slots():
    """`KVCache.padded`: multi-round PARSE's first round drafts over a smaller draft cache, grown for later rounds."""
    from parse_jax.models.cache import KVCache

    k = jnp.arange(2 * 1 * 3 * 2, dtype=jnp.float32).reshape(2, 1, 3, 2)
    cache = KVCache(k=(k,), v=(k + 100.0,), lengths=jnp.array([2, 3], jnp.int32))
    grown = cache.padded(5)
    assert grown.max_len == 5 and grown.lengths.tolist() == [2, 3]
    assert (grown.k[0][:, :, :3] == k).all() and (grown.v[0][:, :, :3] == k + 100.0).all()
    assert float(jnp.abs(grown.k[0][:, :, 3:]).sum() + jnp.abs(grown.v[0][:, :, 3:]).sum()) == 0.0
