"""One verification pass (the device packer + `verify_block`, as the modes and `score_prefixes` run it) equals
separate per-prefix causal passes; its KV commits as a plain prefill's; acceptance and judge words."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parse_jax.errors import ConfigError, InputError
from parse_jax.models.decoder import Decoder, causal_metadata
from parse_jax.runtime.programs import compiled_programs, forward_fn
from parse_jax.verify.block import pack_block
from parse_jax.verify.scoring import accept, judge_ids, score_prefixes, verify_block
from tests.random_models import random_model
from tests.verify.layout_reference import pack, verify_pass

MODEL = random_model("qwen3", 21)
V = MODEL.config.vocab_size
YES, NO = 7, 11
LENGTH, K_MAX, CACHE, FULL = 40, 4, 64, 48


def _causal_logits(ids):
    """Logits of a plain causal forward over ids, right-padded to one shape (causal: padding is unseen)."""
    padded = np.zeros((1, FULL), np.int64)
    padded[0, : len(ids)] = ids
    return MODEL.logits(padded)[0, : len(ids)]


def _causal_score(ids):
    logits = _causal_logits(ids)
    return jax.nn.sigmoid(logits[-1, YES] - logits[-1, NO])


def _prefill(contexts):
    cache = MODEL.init_cache(len(contexts), CACHE)
    width = max(len(c) for c in contexts)
    ids = np.zeros((len(contexts), width), np.int32)
    for i, c in enumerate(contexts):
        ids[i, : len(c)] = c
    limit, group = causal_metadata(len(contexts), width)
    _, cache, _ = MODEL.forward(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(width), ids.shape), cache, limit, group)
    return cache.commit(jnp.asarray([len(c) for c in contexts]))


@functools.cache
def _verify_program(length: int):
    """A verification pass over a prefilled cache as a mode's round runs it: `pack_block` then `verify_block`."""
    module = Decoder(MODEL.config, MODEL.attention_impl)

    def run(params, cache, seq, seq_len, bounds, count, suffix):
        block = pack_block(cache.lengths, seq, seq_len, bounds, count, suffix, length)
        return verify_block(forward_fn(module, params, return_hidden=True), cache, block, YES, NO)[:3]

    return jax.jit(run)


def _verify(cache, drafts, bounds, suffix):
    seq = np.zeros((len(drafts), LENGTH), np.int32)
    ends = np.zeros((len(drafts), K_MAX), np.int32)
    for i, (d, b) in enumerate(zip(drafts, bounds)):
        seq[i, : len(d)] = d
        ends[i, : len(b)] = b
    return _verify_program(LENGTH)(MODEL.params, cache, seq, np.array([len(d) for d in drafts], np.int32), ends,
                                   np.array([len(b) for b in bounds], np.int32), np.asarray(suffix, np.int32))


@st.composite
def request(draw):
    ctx = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=6))
    d = draw(st.integers(1, 14))
    draft = draw(st.lists(st.integers(0, V - 1), min_size=d, max_size=d))
    bounds = sorted(draw(st.sets(st.integers(1, d), min_size=1, max_size=K_MAX)))
    return ctx, draft, bounds


@settings(max_examples=12, deadline=None)
@given(st.lists(request(), min_size=2, max_size=2), st.lists(st.integers(0, V - 1), min_size=1, max_size=4))
def test_single_pass_over_a_cache_equals_separate_passes(reqs, suffix):
    if max(len(d) + len(b) * len(suffix) for _, d, b in reqs) > LENGTH:
        return
    scores, boundary_logits, _ = _verify(_prefill([c for c, _, _ in reqs]), [d for _, d, _ in reqs],
                                         [b for *_, b in reqs], suffix)
    scores = np.asarray(scores)
    for row, (ctx, draft, bounds) in enumerate(reqs):
        for k, b in enumerate(bounds):
            logits = _causal_logits(ctx + draft[:b] + suffix)
            assert abs(scores[row, k] - jax.nn.sigmoid(logits[-1, YES] - logits[-1, NO])) <= 1e-5
            np.testing.assert_allclose(np.asarray(boundary_logits[row, k]), logits[len(ctx) + b - 1],
                                       atol=2e-5, rtol=0)
        assert np.isnan(scores[row, len(bounds):]).all()


@settings(max_examples=12, deadline=None)
@given(st.lists(request(), min_size=1, max_size=3), st.lists(st.integers(0, V - 1), min_size=1, max_size=4))
def test_score_prefixes_equal_separate_passes(reqs, suffix):
    """The prefix scorer (context at the head of the block, over an empty cache), a batch in one pass."""
    if max(len(c) + len(d) + len(suffix) for c, d, _ in reqs) > FULL:
        return
    got = score_prefixes(MODEL, [c + d for c, d, _ in reqs], [[len(c) + b for b in bs] for c, _, bs in reqs],
                         suffix=suffix, yes_id=YES, no_id=NO)
    for (ctx, draft, bounds), scores in zip(reqs, got):
        assert scores.shape == (len(bounds),) and scores.dtype == np.float64
        for k, b in enumerate(bounds):
            assert abs(scores[k] - _causal_score(ctx + draft[:b] + suffix)) <= 1e-5


def test_score_prefixes_reuses_its_program_within_a_bucket():
    """Shapes come from padding buckets: requests of other lengths in the same buckets compile nothing new."""
    rng = np.random.default_rng(5)

    def run(n, k):
        seq = rng.integers(0, V, n).tolist()
        return score_prefixes(MODEL, [seq], [list(range(n - k + 1, n + 1))], suffix=[1, 2], yes_id=YES, no_id=NO)

    run(20, 3)  # a block of 26 tokens: length bucket 32, prefix bucket 4
    before = compiled_programs()
    for n, k in ((17, 4), (24, 3), (12, 4)):
        assert run(n, k)[0].shape == (k,)
    assert compiled_programs() == before
    run(40, 3)  # a longer block: the next bucket, one more program
    assert compiled_programs() == before + 1


def test_committed_kv_equals_a_plain_prefill_of_the_accepted_prefix():
    rng = np.random.default_rng(0)
    ctxs = [rng.integers(0, V, 5).tolist(), rng.integers(0, V, 3).tolist()]
    drafts = [rng.integers(0, V, 12).tolist(), rng.integers(0, V, 9).tolist()]
    bounds = [[3, 7, 12], [4, 9]]
    accepted = [7, 4]
    _, _, cache = _verify(_prefill(ctxs), drafts, bounds, [1, 2, 3])
    cache = cache.commit(jnp.asarray(accepted))
    plain = _prefill([c + d[:a] for c, d, a in zip(ctxs, drafts, accepted)])
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(plain.lengths))
    for layer in range(MODEL.config.num_layers):
        for row, n in enumerate(np.asarray(plain.lengths)):
            for buf, ref in ((cache.k, plain.k), (cache.v, plain.v)):
                np.testing.assert_allclose(np.asarray(buf[layer][row, :, :n]), np.asarray(ref[layer][row, :, :n]),
                                           atol=1e-5, rtol=0)


@pytest.mark.parametrize("scores,threshold,earliest,longest", [
    ([0.9, 0.8, 0.2, 0.9], 0.5, 1, 3),
    ([0.1, 0.9, 0.9, 0.9], 0.5, -1, 3),
    ([0.9, 0.9, 0.9, 0.9], 0.5, 3, 3),
    ([0.9, 0.9, 0.9, 0.9], 1.01, -1, -1),
    ([0.0, 0.0, 0.0, 0.0], 0.0, 3, 3),
    ([0.6, 0.4, 0.6, 0.4], 0.5, 0, 2),
])
def test_acceptance_policies(scores, threshold, earliest, longest):
    s = np.array([scores])
    valid = np.ones_like(s, bool)
    assert accept(s, valid, threshold, "earliest_error")[0] == earliest
    assert accept(s, valid, threshold, "longest_valid")[0] == longest


def test_acceptance_ignores_padded_prefixes():
    s = np.array([[0.9, 0.9, np.nan, np.nan], [0.9, 0.1, 0.9, np.nan]])
    valid = ~np.isnan(s)
    assert accept(s, valid, 0.5).tolist() == [1, 0]
    assert accept(s, valid, 0.5, "longest_valid").tolist() == [1, 2]
    with pytest.raises(ConfigError, match="policy"):
        accept(s, valid, 0.5, "best")


def test_judge_words_are_scored_where_their_tokens_part():
    from parse_jax.models.tokenizer import Tokenizer
    from parse_jax.tasks import TOKENIZER_DIR

    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    [c], [i] = tok.encode("Correct"), tok.encode("Incorrect")
    assert judge_ids(tok, "Correct", "Incorrect") == (c, i, [])
    assert judge_ids(tok, "Correct Incorrect", "Correct Correct") == (i, c, [c])  # the shared token joins the suffix
    with pytest.raises(ConfigError, match="prefix of the other"):
        judge_ids(tok, "Correct", "Correct Incorrect")
    with pytest.raises(ConfigError, match="judge_no 'Zebra' is not in this tokenizer's vocabulary"):
        judge_ids(tok, "Correct", "Zebra")
    with pytest.raises(ConfigError, match="special token"):
        judge_ids(tok, tok.id_to_token(tok.eos_id), "Correct")


def test_reference_block_that_does_not_fit_the_cache_is_refused():
    blk = pack(0, list(range(10)), [10], [1])
    cache = MODEL.init_cache(1, 8)
    with pytest.raises(InputError, match="does not fit the cache"):
        verify_pass(MODEL, cache, [blk], YES, NO)
