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
