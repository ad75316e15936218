"""Sampling filters and the sampled distribution itself."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from parse_jax.runtime.sampling import filter_logits, sample_token


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5, width=32, allow_subnormal=False), min_size=2, max_size=12), st.floats(0.05, 1.0),
       st.integers(0, 12))  # XLA flushes float32 subnormals to zero: one ties with 0.0 there
@example([0.0, 0.0, 1.0, 1.0, 2.0], 0.5, 2)  # top-k keeps a tie, then the nucleus within it is one token
def test_filter_keeps_the_smallest_nucleus_within_top_k(logits, top_p, top_k):
    x = np.array(logits, np.float32)
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(x), 1.0, top_k, top_p)))
    order = np.argsort(-x, kind="stable")
    k = top_k if 0 < top_k < len(x) else len(x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    # kept tokens are a top set: anything kept beats anything dropped
    assert kept[order[0]]
    if (~kept).any():
        assert x[kept].min() >= x[~kept].max()
    # never more than top_k (ties at the k-th value aside)
    assert kept.sum() <= k or np.sum(x >= np.sort(x)[-k]) > k
    # the nucleus is taken within the top-k set, renormalised (top-k first, then top-p, as in HF): the kept
    # tokens strictly above the smallest kept value (ties are kept together) hold less than top_p of that
    # mass, and all kept tokens cover top_p of it
    in_k = x >= np.sort(x)[-k]
    probs_k = np.where(in_k, probs, 0.0)
    probs_k /= probs_k.sum()
    floor = x[kept].min()
    assert probs_k[kept & (x > floor)].sum() < top_p + 1e-5
    assert probs_k[kept].sum() >= top_p - 1e-5


def test_temperature_sampling_matches_softmax():
    logits = jnp.array([[1.0, 0.5, -0.3, 2.0, 0.0]])
    temperature = 0.7
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draws = jax.vmap(lambda k: sample_token(logits, k, False, temperature)[0])(keys)
    freq = np.bincount(np.asarray(draws), minlength=5) / n
    expect = np.asarray(jax.nn.softmax(logits[0] / temperature))
    chi2 = n * np.sum((freq - expect) ** 2 / expect)
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001
    top2 = jax.vmap(lambda k: sample_token(logits, k, False, temperature, top_k=2)[0])(keys)
    assert set(np.unique(np.asarray(top2)).tolist()) == {0, 3}


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(1), (6, 50))
    np.testing.assert_array_equal(sample_token(logits, jax.random.PRNGKey(0), True), np.argmax(logits, -1))
