"""The device segmenter and block packer against their numpy reference (verify/host_segment.py, and
tests/verify/layout_reference.py's `pack` + `verify_arrays`), and the device acceptance against `scoring.accept`:
hypothesis over drafts, delimiters, segmenters and caps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parse_jax.verify.block import pack_block
from parse_jax.verify.host_segment import (
    cap_boundaries,
    confidence_boundaries,
    delimiter_boundaries,
    hybrid_boundaries,
    stride_boundaries,
    value_boundaries,
)
from parse_jax.verify.round import Draft, RoundSpec, segment_draft
from parse_jax.verify.scoring import accept, accept_on_device
from parse_jax.verify.segment import DelimiterTable, segment
from tests.verify.layout_reference import pack, verify_arrays

V, D, ROWS = 7, 24, 6  # a small vocabulary makes delimiter occurrences (and overlaps) common


@functools.cache
def _confidence_fn(segmenter: str, k: int, cutoff: float):
    spec = RoundSpec(segmenter, k, 3, 2, 5, "earliest_error", "confidence", cutoff)
    return jax.jit(lambda draft, draft_len, probs, table: segment_draft(Draft(draft, draft_len, probs), table, spec))


@settings(max_examples=40, deadline=None)
@pytest.mark.parametrize("segmenter", ["delimiter", "stride", "hybrid"])
@pytest.mark.parametrize("k,cutoff", [(1, 1.0), (2, 1.0), (3, 0.5), (4, 1.0), (8, 0.3)])
@given(rows=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=24), min_size=6, max_size=6),
       seed=st.integers(0, 2**16), ties=st.booleans())
def test_confidence_chosen_prefixes_equal_the_numpy_reference(segmenter, k, cutoff, rows, seed, ties):
    """The step ends before the draft's least sure steps (prefix_choice="confidence"), on the device, equal
    `host_segment.confidence_boundaries` over the uncapped boundaries; probabilities with ties (a coarse grid) pick
    the earliest."""
    rng = np.random.default_rng(seed)
    probs = rng.random((6, 24)).astype(np.float32)
    if ties:
        probs = (np.round(probs * 4) / 4).astype(np.float32)
    draft = rng.integers(0, 7, (6, 24)).astype(np.int32)
    for i, r in enumerate(rows):
        draft[i, : len(r)] = r
    lens = np.array([len(r) for r in rows], np.int32)
    table = DelimiterTable.from_ids([1, 2], 7).table
    bounds, count = (np.asarray(x) for x in _confidence_fn(segmenter, k, cutoff)(draft, lens, probs, table))
    for i, r in enumerate(rows):
        full = _reference(r, segmenter, [1, 2], 10**6, 3, 2, 5)
        expect = confidence_boundaries(full, probs[i, : len(r)].tolist(), k, cutoff)
        assert bounds[i, : count[i]].tolist() == expect, (r, probs[i, : len(r)])
        assert expect[-1] == len(r) and len(expect) <= k


def test_confidence_picks_the_ends_before_the_doubtful_steps():
    # steps end after 2, 4, 6, 8 tokens; the draft doubts the step after 4 (token 5) most, then the one after 6
    probs = [0.9, 0.9, 0.95, 0.9, 0.9, 0.2, 0.99, 0.4, 0.9, 0.9]
    assert confidence_boundaries([2, 4, 6, 8, 10], probs, 3) == [4, 6, 10]
    assert confidence_boundaries([2, 4, 6, 8, 10], probs, 3, cutoff=0.3) == [4, 10]
    assert confidence_boundaries([2, 4, 6, 8, 10], probs, 1) == [10]
    assert confidence_boundaries([2, 4, 6, 8, 10], probs, 8) == [2, 4, 6, 8, 10]


@functools.cache
def _value_fn(segmenter: str, k: int, cutoff: float):
    spec = RoundSpec(segmenter, k, 3, 2, 5, "earliest_error", "auto", cutoff)
    return jax.jit(lambda draft, draft_len, probs, table, price: segment_draft(Draft(draft, draft_len, probs), table,
                                                                              spec, price=price))


@settings(max_examples=25, deadline=None)
@pytest.mark.parametrize("segmenter", ["delimiter", "stride", "hybrid"])
@pytest.mark.parametrize("k,cutoff", [(2, 1.0), (3, 0.5), (8, 1.0)])
@given(rows=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=24), min_size=6, max_size=6),
       seed=st.integers(0, 2**16), price=st.sampled_from([0.0, 0.05, 0.5, 2.0, 1e9]))
def test_value_chosen_prefixes_equal_the_numpy_reference(segmenter, k, cutoff, rows, seed, price):
    """prefix_choice="auto" on the device (the ends whose expected saving reaches the price, the most valuable
    first) equals `host_segment.value_boundaries` over the uncapped boundaries; price 0 keeps every eligible end up
    to K - 1, a huge price keeps the full draft alone."""
    rng = np.random.default_rng(seed)
    probs = (0.05 + 0.95 * rng.random((6, 24))).astype(np.float32)  # confident drafts and doubtful ones
    draft = rng.integers(0, 7, (6, 24)).astype(np.int32)
    for i, r in enumerate(rows):
        draft[i, : len(r)] = r
    lens = np.array([len(r) for r in rows], np.int32)
    table = DelimiterTable.from_ids([1, 2], 7).table
    fn = _value_fn(segmenter, k, cutoff)
    bounds, count = (np.asarray(x) for x in fn(draft, lens, probs, table, np.float32(price)))
    for i, r in enumerate(rows):
        full = _reference(r, segmenter, [1, 2], 10**6, 3, 2, 5)
        expect = value_boundaries(full, probs[i, : len(r)].tolist(), k, cutoff, price)
        assert bounds[i, : count[i]].tolist() == expect, (r, probs[i, : len(r)])
        assert expect[-1] == len(r) and len(expect) <= k
        if price >= 1e9:
            assert expect == [len(r)]


def test_value_keeps_the_end_before_a_doubtful_step_and_prices_the_rest_out():
    # steps end after 4, 8, 12 tokens; the draft doubts the step after 8 (token 10 at 0.3), is sure of the others
    probs = [0.99] * 10 + [0.3] + [0.99] * 5
    bounds = [4, 8, 12, 16]
    # end 8 keeps 8 tokens when the doubtful step fails: 8 x 0.99^2 x (1 - 0.3 x 0.99) ~ 5.5; end 4: 4 x 0.99 x
    # (1 - 0.99^2 x 0.3) ~ 2.8; end 12 lies past the doubt: 12 x 0.99^2 x 0.3 x (1 - 0.99) ~ 0.035
    assert value_boundaries(bounds, probs, 8) == [4, 8, 12, 16]           # free: every end
    assert value_boundaries(bounds, probs, 2) == [8, 16]                  # one slot: the most valuable end
    # once 8 is kept, end 4 adds only 4 x 0.99 x (1 - 0.99) ~ 0.04 tokens (a failure after 4 is one after 8 too,
    # unless it falls in the sure step 4..8), and end 12 4 x 0.29 x 0.01: at price 0.03 end 4 pays, at 1.0 neither
    assert value_boundaries(bounds, probs, 8, price=0.03) == [4, 8, 16]
    assert value_boundaries(bounds, probs, 8, price=1.0) == [8, 16]
    assert value_boundaries(bounds, probs, 8, price=3.0) == [8, 16]
    assert value_boundaries(bounds, [0.999] * 16, 8, price=1.0) == [16]  # a sure draft: the full draft alone
    assert value_boundaries(bounds, probs, 8, cutoff=0.2) == [16]         # no step doubted below the cutoff


def test_value_is_marginal_to_the_ends_already_kept():
    # two doubtful steps, (4, 8] and (12, 16] (a token at 0.5 in each): end 4 first (4 x 0.99 x (1 - 0.99 x 0.25) ~
    # 2.98), then end 12 (8 more tokens x 0.49 x 0.5 ~ 1.96); end 8 alone would keep 8 x 0.495 x 0.505 ~ 2.0, but
    # between 4 and 12 it adds 4 x 0.495 x 0.01 ~ 0.02, so at price 1 it is not verified
    probs = [0.99] * 5 + [0.5] + [0.99] * 7 + [0.5] + [0.99] * 2
    bounds = [4, 8, 12, 16]
    assert value_boundaries(bounds, probs, 8, price=1.0) == [4, 12, 16]
    assert value_boundaries(bounds, probs, 8, price=2.0) == [4, 16]
    assert value_boundaries(bounds, probs, 8) == [4, 8, 12, 16]


@functools.cache
def _segment_fn(segmenter: str, k: int):
    def run(draft, draft_len, table, stride, min_len, max_len):
        return segment(draft, draft_len, segmenter, k, table, stride, min_len, max_len)
    return jax.jit(run)


def _reference(draft, segmenter, delim, k, stride, min_len, max_len):
    if segmenter == "delimiter":
        b = delimiter_boundaries(draft, delim)
    elif segmenter == "stride":
        b = stride_boundaries(len(draft), stride)
    else:
        b = hybrid_boundaries(draft, delim, min_len, max_len)
    return cap_boundaries(b, k)


drafts = st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=D), min_size=ROWS, max_size=ROWS)


@settings(max_examples=40, deadline=None)
@pytest.mark.parametrize("segmenter", ["delimiter", "stride", "hybrid"])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
@given(rows=drafts, delim=st.lists(st.integers(0, 2), min_size=1, max_size=3), stride=st.integers(1, 6),
       min_len=st.integers(1, 4), extra=st.integers(0, 6))
def test_device_boundaries_equal_the_numpy_segmenters(segmenter, k, rows, delim, stride, min_len, extra):
    max_len = min_len + extra
    draft = np.zeros((ROWS, D), np.int32)
    for i, r in enumerate(rows):
        draft[i, : len(r)] = r
        draft[i, len(r):] = np.random.default_rng(i).integers(0, V, D - len(r))  # garbage past the end is ignored
    lens = np.array([len(r) for r in rows], np.int32)
    table = DelimiterTable.from_ids(delim, V).table
    bounds, count = _segment_fn(segmenter, k)(draft, lens, table, stride, min_len, max_len)
    bounds, count = np.asarray(bounds), np.asarray(count)
    for i, r in enumerate(rows):
        expect = _reference(r, segmenter, delim, k, stride, min_len, max_len)
        assert bounds[i, : count[i]].tolist() == expect, (r, delim)


def test_delimiter_table_finds_leftmost_non_overlapping_occurrences():
    table = DelimiterTable.from_ids([1, 1], 3).table
    bounds, count = _segment_fn("delimiter", 8)(np.array([[1, 1, 1, 1, 1, 0, 1, 1]], np.int32), np.array([8]),
                                               table, 1, 1, 1)
    assert np.asarray(bounds)[0, : int(count[0])].tolist() == [2, 4, 8] == delimiter_boundaries(
        [1, 1, 1, 1, 1, 0, 1, 1], [1, 1])


@st.composite
def requests(draw):
    ctx = draw(st.integers(0, 9))
    seq_len = draw(st.integers(1, 12))
    k = draw(st.integers(1, 4))
    bounds = sorted(draw(st.sets(st.integers(1, seq_len), min_size=1, max_size=k)))
    return ctx, draw(st.lists(st.integers(0, 50), min_size=seq_len, max_size=seq_len)), bounds, \
        draw(st.integers(0, seq_len - 1))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(requests(), min_size=3, max_size=3), suffix=st.lists(st.integers(0, 50), min_size=1,
                                                                               max_size=3))
def test_device_block_equals_pack_and_verify_arrays(rows, suffix):
    k_max, width, length = 4, 12, 32
    blocks = [pack(c, s, b, suffix) for c, s, b, _ in rows]
    expect = verify_arrays(blocks, length, k_max, [before for *_, before in rows])
    seq = np.zeros((3, width), np.int32)
    bounds = np.zeros((3, k_max), np.int32)
    for i, (_, s, b, _) in enumerate(rows):
        seq[i, : len(s)] = s
        bounds[i, : len(b)] = b
    got = _pack_fn(length)(np.array([c for c, *_ in rows], np.int32), seq, np.array([len(s) for _, s, _, _ in rows]),
                           bounds, np.array([len(b) for *_, b, _ in rows]), np.array(suffix, np.int32),
                           np.array([before for *_, before in rows], np.int32))
    for name in ("tokens", "positions", "limit", "group", "score_index", "boundary_index", "valid"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), expect[name], err_msg=name)
    assert np.asarray(got.num_tokens).tolist() == [b.length for b in blocks]


@functools.cache
def _pack_fn(length):
    return jax.jit(lambda *a: pack_block(*a[:6], length, before=a[6]))


@settings(max_examples=100, deadline=None)
@pytest.mark.parametrize("policy", ["earliest_error", "longest_valid"])
@given(scores=st.lists(st.lists(st.floats(0, 1, width=32, allow_subnormal=False), min_size=5, max_size=5),
                      min_size=4, max_size=4),
       counts=st.lists(st.integers(0, 5), min_size=4, max_size=4),
       threshold=st.floats(0, 1, width=32, allow_subnormal=False))  # XLA:CPU flushes subnormals to zero
def test_device_acceptance_equals_accept(policy, scores, counts, threshold):
    scores = np.array(scores, np.float32)
    valid = np.arange(5)[None, :] < np.array(counts)[:, None]
    expect = accept(scores, valid, np.float32(threshold), policy)
    got = jax.jit(accept_on_device, static_argnums=3)(jnp.asarray(scores), jnp.asarray(valid),
                                                      jnp.float32(threshold), policy)
    assert np.asarray(got).tolist() == expect.tolist()


TEXT_VOCAB = ["", "a", ".", "\n", "\n\n", ".\n\n", ":\n\n", "\n\n\n", "a.", ".\n", "1", "\n\n1", "b\n"]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, len(TEXT_VOCAB) - 1), min_size=1, max_size=D), min_size=ROWS,
                     max_size=ROWS),
       delims=st.lists(st.sampled_from(["\n\n", ".\n", "\n\n\n", "a.", ":", "\n"]), min_size=1, max_size=2,
                       unique=True))
def test_text_delimiters_on_the_device_equal_the_decoded_text_scan(rows, delims):
    """Delimiters found in the decoded text: BPE merges "\\n\\n" with the character before it (".\\n\\n" is one token),
    so a step end is wherever a token's text completes an occurrence, as the numpy scan over the text finds it."""
    from parse_jax.verify.host_segment import text_delimiter_boundaries

    v = len(TEXT_VOCAB)
    table = DelimiterTable.from_texts(TEXT_VOCAB, delims, v).table
    draft = np.zeros((ROWS, D), np.int32)
    for i, r in enumerate(rows):
        draft[i, : len(r)] = r
    lens = np.array([len(r) for r in rows], np.int32)
    bounds, count = _segment_fn("delimiter", D)(draft, lens, table, 1, 1, 1)
    for i, r in enumerate(rows):
        expect = text_delimiter_boundaries([TEXT_VOCAB[t] for t in r], delims)
        assert np.asarray(bounds)[i, : int(count[i])].tolist() == expect, ([TEXT_VOCAB[t] for t in r], delims)


def test_text_boundaries_find_every_step_end_that_token_ids_miss():
    """"\\n\\n" after "." and ":" is merged into one token: matching the delimiter's token ids finds none of these
    step ends; matching the text finds all of them."""
    from parse_jax.verify.host_segment import text_delimiter_boundaries

    texts = ["a", ".\n\n", "b", ":\n\n", "1", "\n\n", "a", ".\n\n\n", "b"]
    assert text_delimiter_boundaries(texts, ["\n\n"]) == [2, 4, 6, 8, 9]
    assert delimiter_boundaries([TEXT_VOCAB.index(t) if t in TEXT_VOCAB else 0 for t in texts],
                                [TEXT_VOCAB.index("\n\n")]) == [6, 9]
