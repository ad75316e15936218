"""The host segmenters (parse_jax/verify/host_segment.py) and the tests' numpy packer (layout_reference.py, the
reference of the device packer), property-tested against docs/design.md §2 written out by hand."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import visibility
from parse_jax.errors import InputError
from parse_jax.utils.validation import check_boundaries
from parse_jax.verify.block import PAD_GROUP
from parse_jax.verify.host_segment import (
    cap_boundaries,
    delimiter_boundaries,
    hybrid_boundaries,
    stride_boundaries,
)
from tests.verify.layout_reference import pack, pad_blocks

drafts = st.lists(st.integers(0, 5), min_size=1, max_size=40)
DELIM = [5]


def _segments(bounds):
    return np.diff([0] + list(bounds))


@given(drafts, st.lists(st.integers(4, 5), min_size=1, max_size=2))
def test_delimiter_boundaries_end_every_delimiter(draft, delim):
    b = delimiter_boundaries(draft, delim)
    assert b[-1] == len(draft) and all(x < y for x, y in zip(b, b[1:]))
    ends = [x for x in b if x >= len(delim) and draft[x - len(delim):x] == delim]
    assert set(b[:-1]) <= set(ends)
    # every non-overlapping occurrence found left to right ends a prefix
    i, found = 0, []
    while i + len(delim) <= len(draft):
        if draft[i:i + len(delim)] == delim:
            found.append(i + len(delim))
            i += len(delim)
        else:
            i += 1
    assert set(found) <= set(b)


@given(st.integers(1, 60), st.integers(1, 12))
def test_stride_boundaries(d, stride):
    b = stride_boundaries(d, stride)
    assert b[-1] == d and all(0 < s <= stride for s in _segments(b))
    assert b[:-1] == list(range(stride, d, stride))


@given(drafts, st.integers(1, 4), st.integers(0, 6))
def test_hybrid_merges_short_and_splits_long_segments(draft, min_len, extra):
    max_len = 2 * min_len + extra
    b = hybrid_boundaries(draft, DELIM, min_len, max_len)
    seg = _segments(b)
    assert b[-1] == len(draft) and (seg > 0).all()
    assert (seg <= max_len).all()
    assert (seg[:-1] >= min_len).all()  # only the whole-draft tail may be short


@given(st.lists(st.integers(1, 200), min_size=1, max_size=50, unique=True), st.integers(1, 10))
def test_cap_keeps_the_full_draft_and_spreads_the_rest(cands, k):
    cands = sorted(cands)
    b = cap_boundaries(cands, k)
    assert len(b) == min(k, len(cands)) and b[-1] == cands[-1]
    assert set(b) <= set(cands) and b == sorted(set(b))
    if len(cands) > k >= 3:
        assert b[0] == cands[0]  # spread evenly: from the first candidate to the last


@st.composite
def requests(draw):
    d = draw(st.integers(1, 12))
    k = draw(st.integers(1, 4))
    bounds = sorted(draw(st.sets(st.integers(1, d), min_size=1, max_size=k)))
    return draw(st.integers(0, 7)), draw(st.lists(st.integers(0, 50), min_size=d, max_size=d)), bounds, \
        draw(st.lists(st.integers(0, 50), min_size=1, max_size=4))


@settings(max_examples=60, deadline=None)
@given(requests())
def test_pack_follows_the_design_table(req):
    ctx, draft, bounds, suffix = req
    blk = pack(ctx, draft, bounds, suffix)
    d, s = len(draft), len(suffix)
    assert blk.length == d + len(bounds) * s
    np.testing.assert_array_equal(blk.tokens, draft + suffix * len(bounds))
    for t in range(d):
        assert blk.positions[t] == ctx + t
    for k, b in enumerate(bounds):
        for j in range(s):
            i = d + k * s + j
            assert blk.positions[i] == ctx + b + j
        assert blk.score_index[k] == d + k * s + s - 1
    # what each query may see, through the attention's own mask
    vis = np.asarray(visibility(jnp.array([ctx]), jnp.asarray(blk.limit[None]), jnp.asarray(blk.group[None]),
                                ctx + blk.length))[0]
    for i in range(blk.length):
        seen = set(np.flatnonzero(vis[i]) - ctx)
        ctx_seen = {x for x in seen if x < 0}
        assert ctx_seen == set(range(-ctx, 0))
        if i < d:
            assert seen - ctx_seen == set(range(i + 1))
        else:
            k, j = divmod(i - d, s)
            assert seen - ctx_seen == set(range(bounds[k])) | set(range(d + k * s, i + 1))


def test_padding_is_invisible():
    a, b = pack(2, [1, 2, 3], [1, 3], [7, 8]), pack(0, [4], [1], [9])
    out = pad_blocks([a, b], 10)
    assert out["tokens"].shape == (2, 10)
    assert (out["group"][1, b.length:] == PAD_GROUP).all() and (out["limit"][1, b.length:] == 0).all()
    vis = np.asarray(visibility(jnp.array([2, 0]), jnp.asarray(out["limit"]), jnp.asarray(out["group"]), 12))
    for row, blk, ctx in ((0, a, 2), (1, b, 0)):
        assert not vis[row, : blk.length, ctx + blk.length:].any()
    with pytest.raises(InputError, match="shorter than the longest"):
        pad_blocks([a], 3)


@pytest.mark.parametrize("bounds,message", [
    ([], "no boundaries"), ([0, 2], "lie in"), ([2, 9], "lie in"), ([3, 2], "increasing"), ([2, 2], "increasing"),
])
def test_bad_boundaries_are_named(bounds, message):
    with pytest.raises(InputError, match=message):
        check_boundaries(bounds, 5)


def test_empty_inputs_are_errors():
    with pytest.raises(InputError, match="draft is empty"):
        delimiter_boundaries([], DELIM)
    with pytest.raises(InputError, match="suffix is empty"):
        pack(0, [1, 2], [2], [])
    with pytest.raises(InputError, match="stride"):
        stride_boundaries(5, 0)
