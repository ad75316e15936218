"""Sampling filters, the sampled distribution itself, and each row's own key: a row's draws depend on its prompt's
seed and its own counters only, never on the other rows of its batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from parse_jax.errors import InputError
from parse_jax.runtime.requests import SamplingParams
from parse_jax.runtime.sampling import Sampler, filter_logits, sample_token


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
    draws = jax.vmap(lambda k: sample_token(logits, k[None], False, temperature)[0])(keys)
    freq = np.bincount(np.asarray(draws), minlength=5) / n
    expect = np.asarray(jax.nn.softmax(logits[0] / temperature))
    chi2 = n * np.sum((freq - expect) ** 2 / expect)
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001
    top2 = jax.vmap(lambda k: sample_token(logits, k[None], False, temperature, top_k=2)[0])(keys)
    assert set(np.unique(np.asarray(top2)).tolist()) == {0, 3}


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(1), (6, 50))
    np.testing.assert_array_equal(sample_token(logits, jax.random.PRNGKey(0), True), np.argmax(logits, -1))


def test_a_rows_draws_do_not_depend_on_the_other_rows():
    """Row keys from per-prompt seeds: a row draws the same token whatever rows sit beside it, in whatever order,
    folded with a shared step or with its own counter, split into streams, and in a batch of one."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 3, 40)), jnp.float32)  # [B, positions, V]: a draw per position
    sampler = Sampler(greedy=False)
    seeds = (7, 123, 7 + 2**20, 99)
    counters = np.array([0, 5, 2, 9])

    def draws(rows: list[int]):
        args = SamplingParams(temperature=1.3, seed=tuple(seeds[r] for r in rows)).args(len(rows))
        a, b = args.fold(3).fold(counters[rows]).split(2)
        picked = logits[np.array(rows)]
        return np.asarray(sampler.sample(picked, a)), np.asarray(sampler.sample(picked, b))

    full_a, full_b = draws([0, 1, 2, 3])
    for rows in ([3, 1, 0, 2], [2], [1, 3]):
        a, b = draws(rows)
        np.testing.assert_array_equal(a, full_a[rows])
        np.testing.assert_array_equal(b, full_b[rows])
    assert not np.array_equal(full_a, full_b)  # the two streams differ
    assert not np.array_equal(full_a[0], full_a[2])  # and so do two seeds on the same logits rows' draws


def test_a_calls_seed_gives_prompt_i_the_seed_plus_i_and_a_list_gives_each_its_own():
    one = SamplingParams(temperature=1.0, seed=2**31 - 2)
    assert one.seeds(0, 3) == (2**31 - 2, 2**31 - 1, 0)  # wrapped into the one seed range
    assert one.rows(1, 3).seeds(0, 2) == one.seeds(1, 3)  # a batch of a call keeps its prompts' seeds
    np.testing.assert_array_equal(one.rows(1, 3).keys(2), one.keys(3)[1:])
    listed = SamplingParams(temperature=1.0, seed=[5, 9])
    assert listed.seed == (5, 9) and listed.seeds(0, 4) == (5, 9, 0, 0)  # padding rows: seed 0
    np.testing.assert_array_equal(listed.keys(2)[1], SamplingParams(temperature=1.0, seed=9).keys(1)[0])
    for seed in (0, 9, 2**31 - 1):  # built on the host, as jax builds them
        np.testing.assert_array_equal(SamplingParams(temperature=1.0, seed=seed).keys(1)[0], jax.random.PRNGKey(seed))
    assert SamplingParams(seed=np.int64(5)).seed == 5 and SamplingParams(seed=np.array([5, 6])).seed == (5, 6)
    with pytest.raises(InputError, match="seed must be an integer"):  # one line, not numpy's TypeError
        SamplingParams(seed=np.array(5))
    assert not SamplingParams().keys(3).any()  # greedy: unread keys
    with pytest.raises(InputError, match=r"seed\[1\]"):
        SamplingParams(seed=[1, -2])
    with pytest.raises(InputError, match="empty list"):
        SamplingParams(seed=[])
