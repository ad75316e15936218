"""`mask.visible`, the one copy of docs/design.md §2's rule, against the rule written out as a Python loop.

The reference and both kernel bodies call `visible`, so this is the test that pins the rule itself; the
kernel tests then only need to show the kernels agree with the reference.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.mask import visible
from tests.pallas_kernels.layouts import rule_mask


@st.composite
def layouts(draw):
    """Any small metadata (groups need not be contiguous; -1 is padding), a cache that may cut the block
    short, a padded tail, and garbage key groups outside the block (`visible` must never read them)."""
    t = draw(st.integers(1, 7))
    ctx = draw(st.integers(0, 6))
    limit = np.array(draw(st.lists(st.integers(0, t), min_size=t, max_size=t)), np.int32)
    group = np.array(draw(st.lists(st.integers(-1, 3), min_size=t, max_size=t)), np.int32)
    num_slots = draw(st.integers(1, ctx + t + 3))
    padded = num_slots + draw(st.integers(0, 4))
    key_group = np.array(draw(st.lists(st.integers(-1, 3), min_size=padded, max_size=padded)), np.int32)
    key_group[ctx:ctx + t] = group[:max(0, padded - ctx)]
    return ctx, limit, group, num_slots, padded, key_group


@settings(max_examples=200, deadline=None)
@given(layouts(), st.booleans())
def test_visible_equals_therule_mask(layout, bounded):
    ctx, limit, group, num_slots, padded, key_group = layout
    slot = jnp.arange(padded, dtype=jnp.int32)[None, :]
    i = jnp.arange(len(limit), dtype=jnp.int32)[:, None]
    got = np.asarray(visible(slot, jnp.int32(ctx), jnp.asarray(key_group)[None, :], jnp.asarray(group)[:, None], i,
                             jnp.asarray(limit)[:, None], len(limit), num_slots if bounded else None))
    want = rule_mask(ctx, limit, group, num_slots if bounded else padded, padded)
    np.testing.assert_array_equal(got, want)


def test_padding_is_invisible_to_real_queries():
    """PAD_GROUP (-1) keys match neither clause for a draft (0) or copy (k >= 1) query, whatever its limit."""
    key_group = jnp.full((1, 4), -1, jnp.int32)
    query_group = jnp.array([[0], [1], [2]], jnp.int32)
    got = visible(jnp.arange(4)[None, :], 0, key_group, query_group, jnp.full((3, 1), 3), jnp.full((3, 1), 4), 4)
    assert not np.asarray(got).any()
