"""EAGLE-3 trees: the expansion is EAGLE-2's, the layout shows every node exactly its ancestors at the right
positions, one target pass over it gives every node the logits of a plain pass over its path, the accepted path's
KV is compacted to what a prefill of it holds, and greedy decoding with trees deeper than one leaf is
token-identical to the target alone (random heads, the embedded pair, a fixture head with a smaller draft
vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mask import visible
from parse_jax.errors import ConfigError
from parse_jax.models.decoder import causal_metadata
from parse_jax.runtime.decode import generate
from parse_jax.settings import Eagle3Settings
from parse_jax.speculation.eagle3 import (
    Tree,
    accept_path,
    compact_kv,
    eagle3_generate,
    expand,
    expand_spine,
    layout,
)
from tests.random_models import random_model
from tests.speculation.test_eagle3 import random_head


def synthetic_tree(rng, n: int, depth: int, used: int) -> Tree:
    """A random tree of `used` nodes (parents first, depth <= `depth`, distinct tokens 100 + node), then unused
    slots; scores fall along every path."""
    parent, dep, score = [], [], []
    for i in range(used):
        choices = [-1] + [j for j in range(i) if dep[j] < depth]
        p = int(rng.choice(choices))
        parent.append(p)
        dep.append(1 if p < 0 else dep[p] + 1)
        score.append((0.0 if p < 0 else score[p]) - float(rng.uniform(0.1, 2.0)))
    pad = n - used
    return Tree(token=jnp.asarray([[100 + i for i in range(n)]], jnp.int32),
                parent=jnp.asarray([parent + [-1] * pad], jnp.int32), depth=jnp.asarray([dep + [0] * pad], jnp.int32),
                score=jnp.asarray([score + [0.0] * pad], jnp.float32),
                valid=jnp.asarray([[True] * used + [False] * pad]))


def node_paths(tree: Tree) -> dict[int, list[int]]:
    """node -> the tokens of its path from the first depth, for every valid node."""
    tok, par = np.asarray(tree.token[0]), np.asarray(tree.parent[0])
    out = {}
    for i in np.flatnonzero(np.asarray(tree.valid[0])):
        path, j = [], int(i)
        while j >= 0:
            path.append(int(tok[j]))
            j = int(par[j])
        out[int(i)] = path[::-1]
    return out


def paths(tree: Tree) -> dict[int, list[int]]:
    """token -> its path, for a tree of distinct tokens."""
    return {int(tree.token[0, i]): p for i, p in node_paths(tree).items()}


@pytest.mark.parametrize("seed", range(12))
def test_the_layout_shows_each_token_its_path(seed):
    """Under docs/design.md §2's visibility rule every block token sees the root and exactly one token per depth
    above it, those of its own path, at RoPE offsets 0..its depth; each node of a kept path is in the block, a leaf
    left out is only one whose copy would not fit."""
    rng = np.random.default_rng(seed)
    depth, n = 4, int(rng.integers(4, 12))
    tree = synthetic_tree(rng, n, depth, int(rng.integers(1, n + 1)))
    lay = layout(tree, jnp.asarray([7], jnp.int32), depth)
    tokens, off = np.asarray(lay.tokens[0]), np.asarray(lay.depth[0])
    group, limit = np.asarray(lay.group[0]), np.asarray(lay.limit[0])
    t = len(tokens)
    i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
    seen = np.asarray(visible(j, 0, group[j], group[i], i, limit[i], t))
    want = paths(tree)
    assert tokens[0] == 7 and group[0] == 0
    for s in range(1, t):
        if group[s] < 0:
            continue
        path = want[int(tokens[s])]
        vis = np.flatnonzero(seen[s])
        assert [int(tokens[x]) for x in sorted(vis, key=lambda x: off[x])] == [7] + path
        assert sorted(off[vis].tolist()) == list(range(len(path) + 1)) and off[s] == len(path)
    # the paths the acceptance reads: kept leaves' slots hold their tokens, each predecessor before it
    ptok, pslot, plen = (np.asarray(x[0]) for x in (lay.path_tok, lay.path_slot, lay.path_len))
    kept = np.flatnonzero(plen > 0)
    assert len(kept) >= 1
    for leaf in kept:
        assert ptok[leaf, : plen[leaf]].tolist() == want[int(ptok[leaf, plen[leaf] - 1])]
        assert tokens[pslot[leaf, : plen[leaf]]].tolist() == ptok[leaf, : plen[leaf]].tolist()
    # every leaf of the tree is in the block unless the slots ran out
    leaves = {p[-1] for p in want.values()} - {q for p in want.values() for q in p[:-1]}
    in_block = {int(ptok[x, plen[x] - 1]) for x in kept}
    if (group >= 0).sum() < t:  # slots to spare: nothing was left out
        assert in_block == leaves
    else:
        assert in_block <= leaves


def test_a_shared_off_trunk_ancestor_is_copied_and_an_overflowing_leaf_left_out():
    # root -> a -> b -> c (the trunk), root -> x -> {y, z}: x is copied for the second of y, z
    tok = [1, 2, 3, 4, 5, 6]
    parent, dep = [-1, 0, 1, -1, 3, 3], [1, 2, 3, 1, 2, 2]
    score = [-0.1, -0.2, -0.3, -1.0, -1.5, -2.0]

    def tree(n):
        pad = n - 6
        return Tree(token=jnp.asarray([tok + [0] * pad], jnp.int32), parent=jnp.asarray([parent + [-1] * pad]),
                    depth=jnp.asarray([dep + [0] * pad]), score=jnp.asarray([score + [0.0] * pad]),
                    valid=jnp.asarray([[True] * 6 + [False] * pad]))

    wide = layout(tree(7), jnp.asarray([9]), 3)  # trunk 3 + [x, y] + [x, z]
    assert np.asarray(wide.tokens[0]).tolist() == [9, 1, 2, 3, 4, 5, 4, 6]
    assert np.asarray(wide.depth[0]).tolist() == [0, 1, 2, 3, 1, 2, 1, 2]
    tight = layout(tree(6), jnp.asarray([9]), 3)  # no slot for the copy: z (the less likely) is left out
    assert np.asarray(tight.tokens[0]).tolist() == [9, 1, 2, 3, 4, 5, 0]
    assert np.asarray(tight.group[0])[-1] == -1
    assert sorted(np.asarray(tight.path_tok[0, :, 1])[np.asarray(tight.path_len[0]) > 0].tolist()) == [2, 5]


def eagle2_reference(step_logits, first_logits, depth, k, nodes, width=None):
    """EAGLE-2's expansion on the host: (token path tuples, cumulative log-probs) of the `nodes` most likely
    candidates, from `step_logits(path) -> logits` of the node ending `path`; `width` frontier nodes per depth
    (default k)."""
    width = width or k
    def logp(x):
        x = np.asarray(x, np.float64)
        return x - np.log(np.exp(x - x.max()).sum()) - x.max()

    first = logp(first_logits)
    cands = [((int(t),), first[t]) for t in np.argsort(-first, kind="stable")[:k]]
    front = cands[:width]
    for _ in range(1, depth):
        kids = []
        for path, s in front:
            lp = logp(step_logits(path))
            kids += [(path + (int(t),), s + lp[t]) for t in np.argsort(-lp, kind="stable")[:k]]
        cands += kids
        front = sorted(kids, key=lambda c: -c[1])[:width]
    return sorted(cands, key=lambda c: -c[1])[:nodes]


@pytest.mark.parametrize("width", [0, 2, 1])
def test_the_expansion_is_eagle2s(width):
    """A stand-in head whose logits are a fixed function of the path: the tree holds exactly the candidates the
    host reference picks (tokens, paths, scores), with k frontier nodes per depth (0), fewer (2), or one: the
    spine, drafted one token per depth with a carried state (`expand_spine`)."""
    v, depth, k, nodes = 7, 4, 3, 10
    rng = np.random.default_rng(3 + width)
    table = rng.normal(0, 2, (depth + 1, v, v)).astype(np.float32)
    first = rng.normal(0, 2, v).astype(np.float32)

    def host_logits(path):
        return table[len(path), path[-1]] + 0.1 * sum(path)

    def head_step(path_tok, path_hid):
        t = path_tok.shape[-1]
        logits = jnp.asarray(table)[t, path_tok[..., -1]] + 0.1 * path_tok.sum(-1, keepdims=True)
        return path_hid[:, :, -1], logits

    def spine_step(carry, token, hidden, i):  # carry: the spine's tokens summed
        carry = carry + token
        return carry, hidden, jnp.asarray(table)[i + 1, token] + 0.1 * carry[:, None]

    if width == 1:
        fn = lambda h, lg: expand_spine(spine_step, jnp.zeros((1,), jnp.int32), h, lg,  # noqa: E731
                                        depth=depth, k=k, nodes=nodes)
    else:
        fn = lambda h, lg: expand(head_step, h, lg, depth=depth, k=k, nodes=nodes, width=width)  # noqa: E731
    tree = jax.jit(fn)(jnp.zeros((1, 2)), jnp.asarray(first)[None])
    got = {tuple(p): float(tree.score[0, i]) for i, p in node_paths(tree).items()}
    want = eagle2_reference(host_logits, first, depth, k, nodes, width)
    assert len(got) == nodes and set(got) == {p for p, _ in want}
    for p, s in want:
        assert got[p] == pytest.approx(s, abs=1e-4)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_the_spine_drafts_the_chain_and_the_one_path_tree(family):
    """From a real EAGLE-3 state (random target and head): the spine, drafted one token per depth on the head's
    cache, proposes the chain's own greedy tokens at every depth, and its tree (tokens, parents, scores) equals
    EAGLE-2's expansion one path wide, which re-reads its path through the head instead."""
    from parse_jax.runtime.requests import SamplingParams
    from parse_jax.speculation.draft_model import spec_args, spec_batch, spec_request
    from parse_jax.speculation.eagle3 import decode

    target = random_model(family, 70, vocab_size=11)
    head = random_head(target, 71, scale=0.3)
    depth, k = 4, 3
    req = spec_request(target, [[3, 5, 1, 7, 2, 9]], 16, SamplingParams(0.0, 0, 1.0, 0), False, None)
    for nodes in (depth * k, depth + 2):  # every candidate, then a cut
        loop = decode.EagleLoop(config=head.config, gamma=depth, num_new=16, tree=nodes - depth, first_pass=1,
                                tree_top_k=k, tree_width=1)
        sb = spec_batch(target, req, gamma=depth, capacity=target.config.max_position_embeddings,
                        extra_slots=loop.slots - depth - 1)

        def trees(tp, hp, prompt, lens, max_new, eos, args, loop=loop, sb=sb, nodes=nodes):
            fns = decode.head_applies(target.config, head.config, target.attention_impl, tp, hp)
            cache, ctx = decode.prefill_with_taps(fns, target.config, prompt, lens, sb.cache_len)
            st = decode.eagle_start(fns, cache, ctx, loop=loop, max_new=max_new, eos_ids=eos,
                                    sampler=sb.sampling.sampler, args=args)
            wide = expand(decode._tree_step(fns, st.head_cache), st.h_last, st.logits_last, depth=depth, k=k,
                          nodes=nodes, width=1)
            props, _ = decode._draft_chain(fns, st, depth, sb.sampling.sampler, args, args)
            return decode.draft_tree(fns, st, loop), wide, props

        spine, wide, props = jax.jit(trees)(*spec_args(target, head.params, sb))
        for field in ("token", "parent", "depth", "valid"):
            np.testing.assert_array_equal(np.asarray(getattr(spine, field)), np.asarray(getattr(wide, field)))
        np.testing.assert_allclose(np.asarray(spine.score), np.asarray(wide.score), atol=1e-4)
        if nodes == depth * k:  # every candidate kept, in candidate order: the spine's node of depth t is t * k
            assert np.asarray(spine.token)[0, ::k].tolist() == np.asarray(props)[0].tolist()


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_one_target_pass_verifies_every_node_and_the_accepted_path_is_compacted(family):
    target = random_model(family, 50)
    v = target.config.vocab_size
    rng = np.random.default_rng(51)
    depth, n = 4, 9
    tree = synthetic_tree(rng, n, depth, n)
    tree = tree.replace(token=jnp.asarray(rng.integers(0, v, (1, n)), jnp.int32))
    ctx = rng.integers(0, v, (1, 6)).astype(np.int32)
    cache = target.init_cache(1, 40)
    lim, grp = causal_metadata(1, 6)
    _, cache, _ = target.forward(jnp.asarray(ctx), jnp.arange(6)[None], cache, lim, grp)
    cache = cache.commit(6)
    root = int(rng.integers(0, v))
    lay = layout(tree, jnp.asarray([root], jnp.int32), depth)
    logits, cache, _ = target.forward(lay.tokens, 6 + lay.depth, cache, lay.limit, lay.group)
    logits = np.asarray(logits[0])
    tokens, group = np.asarray(lay.tokens[0]), np.asarray(lay.group[0])
    ptok, pslot, plen = (np.asarray(x[0]) for x in (lay.path_tok, lay.path_slot, lay.path_len))
    for leaf in np.flatnonzero(plen > 0):  # every slot of every kept path against a plain pass over its path
        full = target.logits(np.concatenate([ctx[0], [root], ptok[leaf, : plen[leaf]]])[None])[0, 6:]
        np.testing.assert_allclose(logits[np.concatenate([[0], pslot[leaf, : plen[leaf]]])], full, atol=2e-5)
    assert (group >= 0).sum() > depth + 1  # some node sat off the trunk
    # make the target "agree" with the longest side path: its argmax replaced along it
    side = [x for x in np.flatnonzero(plen > 0) if pslot[x, plen[x] - 1] > plen[x]]
    leaf = max(side, key=lambda x: plen[x])
    agree = np.argmax(logits, -1).astype(np.int32)
    pred = np.concatenate([[0], pslot[leaf, : plen[leaf] - 1]])
    agree[pred] = ptok[leaf, : plen[leaf]]
    n_acc, emitted, slots = accept_path(lay, jnp.asarray(agree)[None])
    assert int(n_acc[0]) >= plen[leaf]
    best = np.asarray(emitted[0])[: int(n_acc[0])]
    moved = compact_kv(cache, jnp.asarray([6]), slots, n_acc)
    path = np.concatenate([ctx[0], [root], best])
    ref = target.init_cache(1, 40)
    lim, grp = causal_metadata(1, len(path))
    _, ref, _ = target.forward(jnp.asarray(path[None]), jnp.arange(len(path))[None], ref, lim, grp)
    for layer in range(target.config.num_layers):
        for a, b in ((moved.k[layer], ref.k[layer]), (moved.v[layer], ref.v[layer])):
            np.testing.assert_allclose(np.asarray(a[0, :, : len(path)]), np.asarray(b[0, :, : len(path)]), atol=2e-5)
    assert tokens[np.asarray(slots[0])[int(n_acc[0])]] == best[-1]


def test_compaction_moves_only_rows_whose_path_left_the_trunk():
    """A row whose accepted path is the trunk's own prefix has its KV in place already: its cache is left as it is,
    whether or not another row of the batch moves one of its entries."""
    from parse_jax.models.cache import KVCache

    layer = jnp.arange(2 * 3 * 12 * 2, dtype=jnp.float32).reshape(2, 3, 12, 2)  # [B, kv heads, slots, head dim]
    cache = KVCache(k=(layer, -layer), v=(layer + 0.5, 2 * layer), lengths=jnp.asarray([2, 2], jnp.int32))
    start = jnp.asarray([2, 2], jnp.int32)
    n_acc = jnp.asarray([2, 2], jnp.int32)
    on_trunk = jnp.asarray([[0, 1, 2, 0], [0, 1, 2, 0]], jnp.int32)
    left_trunk = jnp.asarray([[0, 1, 2, 0], [0, 1, 6, 0]], jnp.int32)  # row 1's depth-2 token sat in block slot 6
    same = compact_kv(cache, start, on_trunk, n_acc)
    for a, b in zip(same.k + same.v, cache.k + cache.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = compact_kv(cache, start, left_trunk, n_acc)
    for a, b in zip(moved.k + moved.v, cache.k + cache.v):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(a[0], b[0])  # row 0: on the trunk, untouched
        np.testing.assert_array_equal(a[1, :, 2 + 2], b[1, :, 2 + 6])  # row 1: slot 6's entry now at depth 2
        keep = [i for i in range(12) if i != 4]
        np.testing.assert_array_equal(a[1][:, keep], b[1][:, keep])


@pytest.mark.parametrize("family,tree,k,width", [("qwen2", 4, 2, 0), ("qwen3", 8, 3, 0), ("llama3", 3, 2, 1),
                                                 ("qwen3", 4, 3, 1), ("llama3", 6, 4, 2)])
def test_tree_drafting_is_token_identical(family, tree, k, width):
    target = random_model(family, 60, vocab_size=6)
    head = random_head(target, 61, scale=0.3)
    rng = np.random.default_rng(tree)
    prompts = [rng.integers(0, 6, n).tolist() for n in (5, 9, 3, 7)]
    expect = generate(target, prompts, max_new_tokens=24).tokens
    chain = eagle3_generate(target, head, prompts, gamma=3, max_new_tokens=24)
    res = eagle3_generate(target, head, prompts, gamma=3, max_new_tokens=24, tree=tree, tree_top_k=k,
                          tree_width=width)
    assert res.tokens == expect == chain.tokens
    assert res.stats["tree"] == tree and res.stats["num_draft_tokens"] == (3 + tree) * res.stats["num_drafts"]
    assert res.stats["tree_width"] == (width or k)
    if k > 1:  # a tree accepts more per pass than the chain of its depth (a 6-token vocabulary: often)
        assert (res.stats["accepted_tokens"] / res.stats["num_drafts"]
                > chain.stats["accepted_tokens"] / chain.stats["num_drafts"])


def test_a_tree_larger_than_its_candidates_is_refused():
    """Slots no candidate can fill would be verified every pass for nothing (depth 3, top-k 2, width 2: 2 + 2 * 4 =
    10 candidates, 3 of them the trunk; one path wide, 3 * 2; top-k 1 is a chain)."""
    assert Eagle3Settings(gamma=3, tree=7, tree_top_k=2).max_tree == 7
    assert Eagle3Settings(gamma=3, tree=3, tree_top_k=2, tree_width=1).max_tree == 3
    with pytest.raises(ConfigError, match=r"eagle3_tree must be <= 7, got 8: a tree of depth 3 \(eagle3_gamma\) "
                                          r"with eagle3_tree_top_k 2 and eagle3_tree_width 0 proposes 10 candidates"):
        Eagle3Settings(gamma=3, tree=8, tree_top_k=2)
    with pytest.raises(ConfigError, match="eagle3_tree must be <= 0, got 2"):
        Eagle3Settings(gamma=3, tree=2, tree_top_k=1)
    with pytest.raises(ConfigError, match="eagle3_tree must be <= 3, got 4"):
        Eagle3Settings(gamma=3, tree=4, tree_top_k=2, tree_width=1)


def test_trees_on_the_embedded_pair_are_token_identical_and_take_side_paths():
    """The embedded pair's trained head, depth 4 and 3 (and 5, one path wide), float32: eagle3 with trees equals the
    target alone and takes side paths (so the compaction ran); parse+eagle3 with a tree continuation equals the
    target alone when PARSE keeps nothing (threshold 1), and continues exactly as the target would from what it
    keeps (threshold 0)."""
    from parse_jax.checkpoints.pair import load_pair
    from parse_jax.engine import ParseConfig, ParseEngine
    from parse_jax.tasks.arith import load_task

    target, draft = load_pair()
    prompts = [q for q, _ in load_task("default").problems(6, 3)]
    expect = generate(target, prompts, max_new_tokens=24).tokens
    for depth, tree, k, width in ((4, 6, 3, 0), (3, 4, 2, 0), (5, 2, 3, 1)):
        cfg = ParseConfig.from_flat(ParseConfig(schedule="fixed", rounds="single", threshold=1.0),
                                    eagle3_gamma=depth, eagle3_tree=tree, eagle3_tree_top_k=k,
                                    eagle3_tree_width=width)
        eng = ParseEngine(target, draft, cfg)
        assert eng.generate(prompts, mode="eagle3", max_new_tokens=24).tokens == expect, (depth, tree, k)
        assert eng.generate(prompts, mode="parse+eagle3", max_new_tokens=24).tokens == expect, (depth, tree, k)
        keep_all = ParseEngine(target, draft, ParseConfig.from_flat(cfg, threshold=0.0, max_draft_tokens=8))
        res = keep_all.generate(prompts, mode="parse+eagle3", max_new_tokens=24)
        assert_continues_as_the_target(target, prompts, res, 24)
        res = eagle3_generate(target, target.eagle3, prompts, gamma=depth, tree=tree, tree_top_k=k,
                              tree_width=width, max_new_tokens=24)
        assert res.tokens == expect and res.stats["tree_side_paths"] > 0, (depth, tree, k)


def assert_continues_as_the_target(target, prompts, res, budget):
    bos = target.tokenizer.bos_id
    for i, acc in enumerate(res.stats["accepted_per_request"]):
        assert acc > 0
        ids = ([bos] if bos is not None else []) + target.tokenizer.encode(prompts[i]) + res.tokens[i][:acc]
        cont = generate(target, [ids], max_new_tokens=budget - acc).tokens[0] if acc < budget else []
        assert res.tokens[i][acc:] == cont


def test_every_setting_is_checked_with_one_line():
    from parse_jax.errors import ConfigError
    from parse_jax.settings import ParseConfig

    for bad, msg in ((dict(eagle3_tree_top_k=0), "eagle3_tree_top_k must be >= 1"),
                     (dict(eagle3_tree=-2), "eagle3_tree must be >= 0"),
                     (dict(eagle3_tree_width=-1), "eagle3_tree_width must be >= 0"),
                     (dict(eagle3_tree_width=3, eagle3_tree_top_k=2),
                      r"eagle3_tree_width must be <= eagle3_tree_top_k \(2\), got 3"),
                     (dict(eagle3_tree_top_k="x"), "eagle3_tree_top_k")):
        with pytest.raises(ConfigError, match=msg):
            ParseConfig.from_flat(**bad)
    cfg = ParseConfig.load({"eagle3_tree": 6, "eagle3_tree_top_k": 3, "eagle3_gamma": 4})
    assert (cfg.eagle3.gamma, cfg.eagle3.tree, cfg.eagle3.tree_top_k) == (4, 6, 3)
    assert cfg.flat()["eagle3_tree_top_k"] == 3
