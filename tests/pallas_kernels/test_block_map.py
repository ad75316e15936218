"""The block map against the dense mask: every non-empty tile is visited, full tiles are full, and for the
packed layout of docs/design.md §2 (contiguous groups) exactly the non-empty tiles are visited."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import visibility
from pallas_kernels.block_map import first_of_group, key_block_ranges, visited_block
from tests.pallas_kernels.layouts import metadata


def _tiles(mask, block_q, block_k):
    """[T, S] bool -> (any visible, all visible) per (query block, key block), padding counted as visible."""
    t, s = mask.shape
    tp, sp = -(-t // block_q) * block_q, -(-s // block_k) * block_k
    padded_any = np.zeros((tp, sp), bool)
    padded_any[:t, :s] = mask
    padded_all = np.ones((tp, sp), bool)
    padded_all[:t, :s] = mask
    shape = (tp // block_q, block_q, sp // block_k, block_k)
    return padded_any.reshape(shape).any(axis=(1, 3)), padded_all.reshape(shape).all(axis=(1, 3))


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _block_map(lengths, limit, group, num_slots, block_q, block_k):
    """(dense mask, ranges, visited key block and activity per (query block, step)) in one compiled call."""
    mask = visibility(lengths, limit, group, num_slots)
    ranges = key_block_ranges(lengths, limit, group, num_slots, block_q, block_k)
    steps = jnp.arange(-(-num_slots // block_k), dtype=jnp.int32)[None, None, :]
    kb, active = visited_block([ranges[..., r, None] for r in range(4)], steps)
    return mask, ranges, kb, active


def _visited(kb, active, num_k_blocks):
    """Bool [nq, nk]: the key blocks the steps of each query block visit (each at most once)."""
    out = np.zeros((kb.shape[0], num_k_blocks), bool)
    for qi in range(kb.shape[0]):
        blocks = kb[qi][active[qi]]
        assert len(set(blocks.tolist())) == len(blocks), "a key block visited twice"
        out[qi, blocks] = True
    return out


@st.composite
def cases(draw):
    # (T, S, block_q, block_k): few shapes, few compilations
    t, s, block_q, block_k = draw(st.sampled_from([(1, 9, 8, 8), (13, 40, 16, 8), (37, 60, 8, 16), (40, 40, 32, 32),
                                                   (29, 50, 8, 8)]))
    arbitrary = draw(st.booleans())
    return t, s, block_q, block_k, arbitrary, draw(metadata(2, t, s, arbitrary))


@settings(max_examples=30, deadline=None)
@given(cases())
def test_ranges_cover_every_nonempty_tile(case):
    t, s, block_q, block_k, arbitrary, (lengths, limit, group) = case
    mask, ranges, kb, active = (np.asarray(x) for x in _block_map(lengths, limit, group, s, block_q, block_k))
    nk = -(-s // block_k)
    for row in range(len(lengths)):
        nonempty, full = _tiles(mask[row], block_q, block_k)
        visited = _visited(kb[row], active[row], nk)
        assert not (nonempty & ~visited).any(), "a tile with a visible key is skipped"
        if not arbitrary:
            np.testing.assert_array_equal(visited, nonempty)  # packed layouts: no wasted tile
        is_full = np.arange(nk)[None, :] < ranges[row, :, 0:1]
        assert not (is_full & ~full).any(), "a tile marked full has an invisible key"


def test_first_of_group_handles_split_groups():
    group = jnp.array([[0, 2, 2, -1, 1, 2, 0, -1]])
    np.testing.assert_array_equal(np.asarray(first_of_group(group)), [[0, 1, 1, 3, 4, 1, 0, 3]])
