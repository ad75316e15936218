"""The decoder through its cache: incremental and block-wise passes equal the full causal forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.models.decoder import causal_metadata
from parse_jax.models.model import Model
from tests.random_models import FAMILIES, random_model


def _block_pass(model, ids, chunks):
    """Feed ids [B, T] through the cache in chunks of the given sizes; return the logits of every token."""
    b, t = ids.shape
    cache = model.init_cache(b, t + 3)
    out, start = [], 0
    for size in chunks:
        block = jnp.asarray(ids[:, start:start + size], jnp.int32)
        limit, group = causal_metadata(b, size)
        positions = cache.lengths[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]
        logits, cache, _ = model.forward(block, positions, cache, limit, group)
        cache = cache.commit(size)
        out.append(np.asarray(logits))
        start += size
    assert start == t
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize("family,seed", [("llama3", 0), ("qwen2", 1), ("qwen3", 2)])
def test_incremental_decoding_equals_full_forward(family, seed):
    model = random_model(family, seed)
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, (2, 24))
    full = model.logits(ids)
    one_by_one, cache = _block_pass(model, ids, [1] * 24)
    np.testing.assert_allclose(one_by_one, full, atol=2e-5, rtol=0)
    mixed, _ = _block_pass(model, ids, [7, 1, 8, 7, 1])
    np.testing.assert_allclose(mixed, full, atol=2e-5, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [24, 24]


def test_rollback_hides_uncommitted_block():
    """A block written but not committed is invisible: the next pass overwrites it."""
    model = random_model("qwen3", 3)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, model.config.vocab_size, (1, 12))
    junk = jnp.asarray(rng.integers(0, model.config.vocab_size, (1, 6)), jnp.int32)
    cache = model.init_cache(1, 20)
    limit, group = causal_metadata(1, 8)
    _, cache, _ = model.forward(jnp.asarray(ids[:, :8], jnp.int32), jnp.arange(8)[None], cache, limit, group)
    cache = cache.commit(8)
    limit, group = causal_metadata(1, 6)
    _, cache, _ = model.forward(junk, 8 + jnp.arange(6)[None], cache, limit, group)  # rolled back: not committed
    limit, group = causal_metadata(1, 4)
    logits, _, _ = model.forward(jnp.asarray(ids[:, 8:], jnp.int32), 8 + jnp.arange(4)[None], cache, limit, group)
    np.testing.assert_allclose(np.asarray(logits), model.logits(ids)[:, 8:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefix_copies_in_one_pass_equal_separate_passes(family):
    """docs/design.md §2 metadata: each suffix copy scores as if it followed its prefix alone."""
    model = random_model(family, 5)
    rng = np.random.default_rng(5)
    v = model.config.vocab_size
    ctx, draft, suffix = rng.integers(0, v, 6), rng.integers(0, v, 10), rng.integers(0, v, 3)
    bounds = [2, 5, 10]
    block = np.concatenate([draft] + [suffix] * len(bounds))
    limit = list(range(1, len(draft) + 1))
    group = [0] * len(draft)
    positions = list(range(len(ctx), len(ctx) + len(draft)))
    for k, bnd in enumerate(bounds, start=1):
        limit += [bnd] * len(suffix)
        group += [k] * len(suffix)
        positions += [len(ctx) + bnd + j for j in range(len(suffix))]
    cache = model.init_cache(1, 64)
    cl, cg = causal_metadata(1, len(ctx))
    _, cache, _ = model.forward(jnp.asarray(ctx[None], jnp.int32), jnp.arange(len(ctx))[None], cache, cl, cg)
    cache = cache.commit(len(ctx))
    logits, _, _ = model.forward(jnp.asarray(block[None], jnp.int32), jnp.asarray([positions], jnp.int32), cache,
                                 jnp.asarray([limit], jnp.int32), jnp.asarray([group], jnp.int32))
    logits = np.asarray(logits)[0]
    for k, bnd in enumerate(bounds):
        alone = model.logits(np.concatenate([ctx, draft[:bnd], suffix])[None])[0, -len(suffix):]
        start = len(draft) + k * len(suffix)
        np.testing.assert_allclose(logits[start:start + len(suffix)], alone, atol=2e-5, rtol=0)


def test_bfloat16_model_runs_and_tracks_float32():
    model = random_model("llama3", 2)
    bf = Model(model.config.replace(dtype="bfloat16"),
               jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), model.params))
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, (1, 16))
    a, b = model.logits(ids), bf.logits(ids)
    assert b.dtype == np.float32 and np.isfinite(b).all()
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
