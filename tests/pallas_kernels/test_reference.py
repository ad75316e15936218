"""The XLA reference attention against docs/design.md §2's rule written out token by token."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import attention_reference, visibility
from tests.pallas_kernels.layouts import rule_mask


@st.composite
def layouts(draw):
    """A packed verification block: draft, then K suffix copies, inside a cache with free slots."""
    ctx = draw(st.integers(0, 6))
    d = draw(st.integers(1, 8))
    k = draw(st.integers(0, 3))
    s = draw(st.integers(1, 3))
    bounds = sorted(draw(st.lists(st.integers(1, d), min_size=k, max_size=k)))
    limit = list(range(1, d + 1))
    group = [0] * d
    for idx, b in enumerate(bounds, start=1):
        limit += [b] * s
        group += [idx] * s
    free = draw(st.integers(0, 4))
    return ctx, np.array(limit, np.int32), np.array(group, np.int32), ctx + len(limit) + free


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_visibility_matches_therule_mask(layout):
    ctx, limit, group, slots = layout
    got = np.asarray(visibility(jnp.array([ctx]), jnp.asarray(limit[None]), jnp.asarray(group[None]), slots))[0]
    np.testing.assert_array_equal(got, rule_mask(ctx, limit, group, slots))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 6), st.integers(0, 1), st.integers(0, 2), st.integers(0, 3))
def test_one_token_blocks_take_the_samerule_mask(ctx, limit, group, free):
    """T = 1 (every decode step) has its own gather-free path."""
    slots = ctx + 1 + free
    got = np.asarray(visibility(jnp.array([ctx]), jnp.array([[limit]]), jnp.array([[group]]), slots))[0]
    np.testing.assert_array_equal(got, rule_mask(ctx, np.array([limit]), np.array([group]), slots))


@settings(max_examples=15, deadline=None)
@given(layouts(), st.sampled_from([(4, 1), (4, 2), (2, 2)]), st.integers(0, 2**16))
def test_attention_equals_softmax_over_visible_keys(layout, heads, seed):
    ctx, limit, group, slots = layout
    h, kv = heads
    rng = np.random.default_rng(seed)
    t, d = len(limit), 8
    q = rng.normal(size=(1, t, h, d)).astype(np.float32)
    k = rng.normal(size=(1, kv, slots, d)).astype(np.float32)
    v = rng.normal(size=(1, kv, slots, d)).astype(np.float32)
    out = np.asarray(attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.array([ctx]),
                                         jnp.asarray(limit[None]), jnp.asarray(group[None])))
    mask = rule_mask(ctx, limit, group, slots)
    for i in range(t):
        for head in range(h):
            kh = head // (h // kv)
            vis = mask[i]
            scores = k[0, kh, vis] @ q[0, i, head] / np.sqrt(d)
            p = np.exp(scores - scores.max())
            p /= p.sum()
            np.testing.assert_allclose(out[0, i, head], p @ v[0, kh, vis], atol=1e-5)


def test_rows_with_no_visible_key_give_zeros_not_nan():
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 2, 4))
    k = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 4, 4))  # [B, KV, S, D]
    # No context and limit 0 for draft queries: nothing is visible.
    limit, group = jnp.array([[0, 0]]), jnp.array([[0, 0]])
    out = attention_reference(q, k, k, jnp.array([0]), limit, group)
    assert np.isfinite(np.asarray(out)).all() and np.abs(np.asarray(out)).max() == 0
