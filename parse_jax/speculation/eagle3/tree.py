"""EAGLE-3 trees (EAGLE-2's dynamic expansion): the head expands the `k` most likely nodes of each depth (or fewer:
one, the chain's own, in `expand_spine`), the most likely `nodes` candidates by cumulative draft log-prob form the
tree, ONE target pass verifies every node (docs/design.md §2's prefix layout: the trunk is group 0, each other
leaf's off-trunk part its own group), the longest path the target agrees with is accepted and its KV moved into
place.

Shapes are static: `width` (at most `k`) frontier nodes per depth, `nodes` block slots after the root. A node
appears once unless two leaves share an off-trunk ancestor, which the layout then copies; a leaf whose copy would
overflow the slots is left out (the trunk and the most likely leaves come first). Greedy only: a path is accepted
token by token against the target's argmax, so the output is the target's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from parse_jax.models.cache import KVCache
from parse_jax.models.config import MASKED_LOGIT
from parse_jax.verify.block import PAD_GROUP

NEG = -jnp.inf


@struct.dataclass
class Tree:
    """The drafted tree of each row: `nodes` entries in candidate order (a parent before its children)."""

    token: jax.Array   # [B, N] token ids
    parent: jax.Array  # [B, N] index of the parent node, -1: the root (the last emitted token)
    depth: jax.Array   # [B, N] 1..D
    score: jax.Array   # [B, N] cumulative draft log-prob
    valid: jax.Array   # [B, N] False: an unused slot (fewer likely candidates than slots)


@struct.dataclass
class Layout:
    """A tree laid out as one verification block of 1 + N tokens (the root first)."""

    tokens: jax.Array     # [B, 1 + N]
    depth: jax.Array      # [B, 1 + N] RoPE offset from the root (0 for the root and padding)
    limit: jax.Array      # [B, 1 + N] docs/design.md §2 mask metadata
    group: jax.Array      # [B, 1 + N]
    leaf_ok: jax.Array    # [B, N] node n ends a path that is in the block (the trunk or a kept leaf)
    path_slot: jax.Array  # [B, N, D] block slot of the depth-(d + 1) token of leaf n's path (0 past its depth)
    path_tok: jax.Array   # [B, N, D] that token (-1 past the leaf's depth)
    path_len: jax.Array   # [B, N] the leaf's depth
    trunk: jax.Array      # [B] the trunk's leaf


def slots_needed(gamma: int, tree: int, k: int, width: int = 0) -> int:
    """Cache slots a round writes past the committed length: the target's block (1 + gamma + tree nodes) and the
    head's widest drafting block (`width` paths, 0: k, of up to gamma - 1 tokens)."""
    if not tree:
        return gamma + 1
    return max(gamma + 1 + tree, min(width or k, k) * (gamma - 1))


def expand(head_step: Callable, h_last: jax.Array, logits_last: jax.Array, *, depth: int, k: int,
           nodes: int, width: int = 0) -> Tree:
    """EAGLE-2's expansion: the k most likely first tokens, then at each depth the head runs the w frontier nodes
    (`width`, 0: k; each re-reading its own path as one prefix group, so it sees exactly its ancestors), each
    proposes its k most likely children, the w most likely of those w*k become the next frontier; every candidate
    is kept and the `nodes` most likely form the tree. `head_step(tokens [B, w, t], hiddens [B, w, t, d]) -> (out
    [B, w, d], logits [B, w, V])` at the paths' last tokens."""
    b, v = logits_last.shape
    k = min(k, v)
    rows = jnp.arange(b)[:, None]
    children = functools.partial(_children, k=k)
    w = min(width or k, k)
    c_score, c_tok = children(logits_last[:, None], jnp.zeros((b, 1)))
    toks, scores, parents, depths = [c_tok[:, 0]], [c_score[:, 0]], [jnp.full((b, k), -1, jnp.int32)], [1]
    score = c_score[:, 0, :w]  # children come most likely first: the frontier is the first w
    front = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32)[None], (b, w))  # candidate index of each frontier node
    path_tok = c_tok[:, 0, :w, None]
    path_hid = jnp.broadcast_to(h_last[:, None, None], (b, w, 1, h_last.shape[-1]))
    offset = k
    for t in range(1, depth):
        out, logits = head_step(path_tok, path_hid)
        c_score, c_tok = children(logits, score)  # [B, w, k]
        toks.append(c_tok.reshape(b, w * k))
        scores.append(c_score.reshape(b, w * k))
        parents.append(jnp.repeat(front, k, axis=1))
        depths.append(t + 1)
        score, pick = jax.lax.top_k(c_score.reshape(b, w * k), w)
        par = pick // k  # the frontier node each new one descends from
        tok = c_tok.reshape(b, w * k)[rows, pick]
        path_tok = jnp.concatenate([path_tok[rows, par], tok[..., None]], axis=2)
        path_hid = jnp.concatenate([path_hid[rows, par], out[rows, par][:, :, None]], axis=2)
        front = (offset + pick).astype(jnp.int32)
        offset += w * k
    return _most_likely(toks, scores, parents, depths, nodes=nodes, depth=depth)


def expand_spine(step: Callable, carry, h_last: jax.Array, logits_last: jax.Array, *, depth: int, k: int,
                 nodes: int) -> Tree:
    """The expansion one path wide: the spine (each depth's most likely token after the one before: the chain
    EAGLE-3 drafts) and, as candidates, the `k` most likely children of each spine node, so the tree is the chain
    with its likeliest siblings as leaves, drafted at the chain's cost (one head token per depth on the head's own
    cache, where a wider frontier re-reads its paths). `step(carry, token [B], hidden [B, d], i) -> (carry, out
    [B, d], logits [B, V])`: the head after the spine's depth-(i + 1) token."""
    b, v = logits_last.shape
    k = min(k, v)
    toks, scores, parents, depths = [], [], [], []
    base, hidden, logits = jnp.zeros((b,)), h_last, logits_last
    for t in range(depth):
        c_score, c_tok = _children(logits[:, None], base[:, None], k=k)
        c_score, c_tok = c_score[:, 0], c_tok[:, 0]  # [B, k], the spine's own child first
        toks.append(c_tok)
        scores.append(c_score)
        parents.append(jnp.full((b, k), (t - 1) * k if t else -1, jnp.int32))  # the spine node one depth up
        depths.append(t + 1)
        if t + 1 < depth:
            carry, hidden, logits = step(carry, c_tok[:, 0], hidden, t)
        base = c_score[:, 0]
    return _most_likely(toks, scores, parents, depths, nodes=nodes, depth=depth)


def _children(logits: jax.Array, base: jax.Array, *, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most likely children of each frontier node (`logits` [B, F, V], `base` [B, F] its cumulative
    log-prob): scores [B, F, k] (cumulative) and tokens, most likely first."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.where(logits <= MASKED_LOGIT / 2, NEG, logp)  # outside the draft vocabulary: never proposed
    s, t = jax.lax.top_k(logp, k)
    return base[..., None] + s, t.astype(jnp.int32)


def _most_likely(toks: list, scores: list, parents: list, depths: list, *, nodes: int, depth: int) -> Tree:
    """The tree of the `nodes` most likely candidates (given per depth, as [B, n] arrays; a parent's candidate index
    before its children), in candidate order; a node whose parent was cut is cut too."""
    b = toks[0].shape[0]
    rows = jnp.arange(b)[:, None]
    all_tok, all_score = jnp.concatenate(toks, 1), jnp.concatenate(scores, 1)
    all_parent = jnp.concatenate(parents, 1)
    all_depth = jnp.concatenate([jnp.full((b, x.shape[1]), d, jnp.int32) for x, d in zip(toks, depths)], 1)
    n = min(nodes, all_tok.shape[1])
    _, sel = jax.lax.top_k(all_score, n)
    sel = jnp.sort(sel, axis=1)  # candidate order: parents first
    where = jnp.full(all_tok.shape, -1, jnp.int32).at[rows, sel].set(jnp.arange(n, dtype=jnp.int32)[None])
    parent_c = all_parent[rows, sel]
    parent = jnp.where(parent_c >= 0, where[rows, jnp.maximum(parent_c, 0)], -1)
    valid = (all_score[rows, sel] > NEG) & ((parent_c < 0) | (parent >= 0))
    for _ in range(depth):  # a node whose parent is not in the tree (a tie at the cut) is not either
        valid = valid & ((parent < 0) | valid[rows, jnp.maximum(parent, 0)])
    tree = Tree(token=all_tok[rows, sel], parent=parent, depth=all_depth[rows, sel], score=all_score[rows, sel],
                valid=valid)
    if n < nodes:  # fewer candidates than slots: pad
        pad = nodes - n
        tree = jax.tree.map(lambda x: jnp.concatenate([x, jnp.zeros((b, pad), x.dtype)], 1), tree)
        tree = tree.replace(parent=tree.parent.at[:, n:].set(-1))
    return tree


def layout(tree: Tree, root: jax.Array, depth: int) -> Layout:
    """The block [root, trunk, leaf segments]: the trunk (the path to the most likely deepest node) is group 0 at
    slots 1..its depth; every other leaf's nodes below its last trunk ancestor follow as group 1 + leaf, seeing the
    trunk up to there (`limit`), most likely leaves first while they fit."""
    b, n = tree.token.shape
    rows = jnp.arange(b)[:, None]
    nid = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (b, n))
    # anc[b, n, d]: the node at depth d + 1 on node n's path (-1 past its depth)
    anc = jnp.full((b, n, depth), -1, jnp.int32)
    cur = jnp.where(tree.valid, nid, -1)
    for _ in range(depth):
        d = tree.depth[rows, jnp.maximum(cur, 0)] - 1
        hit = jax.nn.one_hot(d, depth, dtype=bool) & (cur >= 0)[..., None]
        anc = jnp.where(hit, cur[..., None], anc)
        cur = jnp.where(cur >= 0, tree.parent[rows, jnp.maximum(cur, 0)], -1)
    has_child = ((tree.parent[:, None, :] == nid[..., None]) & tree.valid[:, None, :]).any(-1)
    leaf = tree.valid & ~has_child
    deepest = jnp.max(jnp.where(leaf, tree.depth, 0), axis=1, keepdims=True)
    trunk = jnp.argmax(jnp.where(leaf & (tree.depth == deepest), tree.score, NEG), axis=1).astype(jnp.int32)
    trunk_path = anc[rows[:, 0], trunk]  # [B, D]
    trunk_len = jnp.where(tree.valid.any(1), tree.depth[rows[:, 0], trunk], 0)
    on_trunk = ((nid[..., None] == trunk_path[:, None, :]) & (trunk_path[:, None, :] >= 0)).any(-1)
    # each leaf off the trunk: its nodes below the branch point, in a segment of its own
    branch = (on_trunk[rows[..., None], jnp.maximum(anc, 0)] & (anc >= 0)).sum(-1)  # [B, N] trunk nodes on its path
    is_side = leaf & (nid != trunk[:, None])
    seg = jnp.where(is_side, tree.depth - branch, 0)
    order = jnp.argsort(jnp.where(is_side, -tree.score, jnp.inf), axis=1)  # most likely first
    seg_sorted = seg[rows, order]
    end_sorted = jnp.cumsum(seg_sorted, axis=1)
    fits_sorted = is_side[rows, order] & (trunk_len[:, None] + end_sorted <= n)
    inv = jnp.argsort(order, axis=1)
    start = (end_sorted - seg_sorted)[rows, inv]  # the segment's first slot after the trunk
    kept = fits_sorted[rows, inv]
    # where every path token sits: the trunk's own slots up to the branch point, then the leaf's segment
    d_ix = jnp.arange(depth, dtype=jnp.int32)[None, None]
    is_trunk = nid == trunk[:, None]
    base = jnp.where(is_trunk, 0, trunk_len[:, None] + start)[..., None]
    br = jnp.where(is_trunk, 0, branch)[..., None]
    path_len = jnp.where(kept | (is_trunk & tree.valid), tree.depth, 0)
    in_path = d_ix < path_len[..., None]
    slot = jnp.where(d_ix < br, 1 + d_ix, 1 + base + d_ix - br)
    path_slot = jnp.where(in_path, slot, 0)
    path_tok = jnp.where(in_path, tree.token[rows[..., None], jnp.maximum(anc, 0)], -1)
    # the block: write each kept path's own tokens (trunk: all; leaves: below the branch point)
    own = in_path & (d_ix >= br)
    width = 1 + n
    dst = jnp.where(own, path_slot, width).reshape(b, n * depth)  # out of range: dropped
    group_of = jnp.where(is_trunk, 0, 1 + nid)[..., None]
    limit_of = jnp.where(is_trunk[..., None], 2 + d_ix, 1 + br)
    flat_rows = jnp.broadcast_to(rows, (b, n * depth))

    def put(base_row, value):
        return base_row.at[flat_rows, dst].set(jnp.broadcast_to(value, (b, n, depth)).reshape(b, n * depth),
                                               mode="drop")

    tokens = put(jnp.zeros((b, width), jnp.int32).at[:, 0].set(root), path_tok)
    depth_of = put(jnp.zeros((b, width), jnp.int32), 1 + d_ix)
    group = put(jnp.full((b, width), PAD_GROUP, jnp.int32).at[:, 0].set(0), group_of)
    limit = put(jnp.zeros((b, width), jnp.int32).at[:, 0].set(1), limit_of)
    return Layout(tokens=tokens, depth=depth_of, limit=limit, group=group, leaf_ok=path_len > 0,
                  path_slot=path_slot, path_tok=path_tok, path_len=path_len, trunk=trunk)


def accept_path(lay: Layout, target_tok: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance over every path in the block: a path's tokens are accepted while each equals the target's
    argmax at its parent's slot (`target_tok` [B, 1 + N]); the longest wins. Returns (n_acc [B], emitted [B, D + 1]:
    the accepted tokens then the target's next token, slots [B, D + 1]: the block slot of each emitted token's
    predecessor, root first)."""
    b, n, depth = lay.path_tok.shape
    rows = jnp.arange(b)[:, None]
    pred = jnp.concatenate([jnp.zeros((b, n, 1), jnp.int32), lay.path_slot[..., :-1]], axis=2)  # parent slots
    match = (lay.path_tok == target_tok[rows[..., None], pred]) & (jnp.arange(depth)[None, None] < lay.path_len[
        ..., None])
    run = jnp.argmin(jnp.concatenate([match, jnp.zeros((b, n, 1), bool)], axis=2), axis=2)  # leading matches
    run = jnp.where(lay.leaf_ok, run, 0)  # a slot that ends no path in the block accepts nothing
    best = jnp.argmax(run, axis=1)
    n_acc = run[rows[:, 0], best].astype(jnp.int32)
    slots = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), lay.path_slot[rows[:, 0], best]], axis=1)  # [B, D + 1]
    toks = lay.path_tok[rows[:, 0], best]
    bonus = target_tok[rows[:, 0], slots[rows[:, 0], n_acc]]
    i = jnp.arange(depth + 1)[None]
    emitted = jnp.where(i < n_acc[:, None], jnp.concatenate([toks, toks[:, :1]], 1), bonus[:, None])
    return n_acc, emitted.astype(jnp.int32), slots


def compact_kv(cache: KVCache, start: jax.Array, slots: jax.Array, n_acc: jax.Array) -> KVCache:
    """Move the accepted path's KV (block slots `slots[:, 1:]`, from `start`) to the slots right after the root, so
    the cache holds the path as a plain prefill would; each entry was computed at its RoPE position, so nothing is
    recomputed."""
    b, w = slots.shape
    rows = jnp.arange(b)[:, None]
    d = jnp.arange(1, w)[None]
    src = jnp.clip(start[:, None] + slots[:, 1:], 0, cache.max_len - 1)
    move = (d <= n_acc[:, None]) & (slots[:, 1:] != d)
    dst = jnp.where(move, start[:, None] + d, cache.max_len)  # out of range: dropped

    def put(buf):
        return buf.at[rows, :, dst].set(buf[rows, :, src], mode="drop")

    return cache.replace(k=tuple(put(x) for x in cache.k), v=tuple(put(x) for x in cache.v))
