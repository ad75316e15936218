"""What one EAGLE-3 round costs as a chain and as a tree, part by part (embedded pair, batch 1, device time).

    python benchmarks/bench_eagle3_tree_cost.py [--depth 5] [--tree 1] [--top-k 2] [--width 0] [--calls 100]
        [--repeats 5]
        [--out benchmarks/results/bench_eagle3_tree_d5/round_cost.md]

A tree pays back only where its extra accepted tokens per pass outgrow its extra cost per round. This times each
part of a round as its own jitted program, from the same state (after the prefill of one held-out problem): the
whole round (chain, tree), the drafting (the chain's head steps, the tree's top-k expansion), the tree's layout,
acceptance and KV compaction, one head step over one token and over the tree's widest step, and the target pass
over the chain's and the tree's blocks. Parts are interleaved (each part `--calls` times per repeat, repeats in
turn); a figure is the median over repeats of the per-call median, in milliseconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.checkpoints.pair import load_pair
from parse_jax.models.decoder import causal_metadata
from parse_jax.runtime.requests import SamplingParams
from parse_jax.speculation.draft_model import spec_args, spec_batch, spec_request
from parse_jax.speculation.eagle3 import decode
from parse_jax.speculation.eagle3.tree import accept_path, compact_kv, layout
from parse_jax.tasks.arith import load_task


def parts(depth: int, tree: int, top_k: int, width: int) -> dict:
    """name -> (jitted function, its arguments), all from one EAGLE-3 state of the embedded pair."""
    target, _ = load_pair()
    head = target.eagle3
    prompt = load_task("default").problems(1, 0)[0][0]
    req = spec_request(target, [prompt], 32, SamplingParams(0.0, 0, 1.0, 0), True, None)
    chain_loop = decode.EagleLoop(config=head.config, gamma=depth, num_new=32, first_pass=1)
    tree_loop = decode.EagleLoop(config=head.config, gamma=depth, num_new=32, tree=tree, first_pass=1,
                                 tree_top_k=top_k, tree_width=width)
    sb = spec_batch(target, req, gamma=depth, capacity=target.config.max_position_embeddings,
                    extra_slots=tree_loop.slots - depth - 1)
    sampler, cfg = sb.sampling.sampler, target.config
    tp, hp, prompt_ids, lens, max_new, eos, args = spec_args(target, head.params, sb)

    def fns(tp, hp):
        return decode.head_applies(cfg, head.config, target.attention_impl, tp, hp)

    @jax.jit
    def start(tp, hp):
        f = fns(tp, hp)
        cache, ctx = decode.prefill_with_taps(f, cfg, prompt_ids, lens, sb.cache_len)
        return decode.eagle_start(f, cache, ctx, loop=tree_loop, max_new=max_new, eos_ids=eos, sampler=sampler,
                                  args=args)

    st = start(tp, hp)

    def round_of(loop):
        return jax.jit(lambda tp, hp, st: decode.eagle_round(fns(tp, hp), st, loop=loop, max_new=max_new,
                                                             eos_ids=eos, sampler=sampler, args=args))

    def expand_tree(tp, hp, st):
        return decode.draft_tree(fns(tp, hp), st, tree_loop)

    drafted = jax.jit(expand_tree)(tp, hp, st)
    lay = jax.jit(lambda t, last: layout(t, last, depth))(drafted, st.last)
    target_tok = jnp.zeros(lay.tokens.shape, jnp.int32)
    n_acc, _, slots = jax.jit(accept_path)(lay, target_tok)
    paths = min(width or top_k, top_k)
    hidden = st.h_last.shape[-1]

    def tree_step(tp, hp, st):  # the widest step: `paths` paths of depth - 1 tokens
        tokens = jnp.zeros((1, paths, depth - 1), jnp.int32)
        return decode._tree_step(fns(tp, hp), st.head_cache)(tokens, jnp.zeros((1, paths, depth - 1, hidden)))

    def chain_step(tp, hp, st):
        _, head_apply, lm = fns(tp, hp)
        limit, group = causal_metadata(1, 1)
        out, normed, _ = head_apply(st.last[:, None], st.h_last[:, None], False, st.head_cache.lengths[:, None],
                                    st.head_cache, limit, group)
        return out, lm(normed[:, 0])

    def target_pass(tp, hp, st, block):
        limit, group = causal_metadata(1, block.shape[1])
        pos = st.target_cache.lengths[:, None] + jnp.arange(block.shape[1])[None]
        return fns(tp, hp).target(block, pos, st.target_cache, limit, group)[0]

    chain_block, tree_block = jnp.zeros((1, depth + 1), jnp.int32), jnp.zeros((1, depth + 1 + tree), jnp.int32)
    table = {
        "round, chain": (round_of(chain_loop), (tp, hp, st)),
        "round, tree": (round_of(tree_loop), (tp, hp, st)),
        "drafting, chain (head steps)": (jax.jit(lambda tp, hp, st: decode._draft_chain(
            fns(tp, hp), st, depth, sampler, args, args)), (tp, hp, st)),
        "drafting, tree" + (" (the spine: head steps)" if paths == 1 else " (top-k expansion)"):
            (jax.jit(expand_tree), (tp, hp, st)),
        "tree layout": (jax.jit(lambda t, last: layout(t, last, depth)), (drafted, st.last)),
        "tree acceptance": (jax.jit(accept_path), (lay, target_tok)),
        "tree KV compaction": (jax.jit(compact_kv), (st.target_cache, st.target_cache.lengths, slots, n_acc)),
        "head step, 1 token": (jax.jit(chain_step), (tp, hp, st)),
        f"head step, {paths} paths x {depth - 1} tokens": (jax.jit(tree_step), (tp, hp, st)),
        f"target pass, {depth + 1} tokens (chain)": (jax.jit(target_pass), (tp, hp, st, chain_block)),
        f"target pass, {depth + 1 + tree} tokens (tree)": (jax.jit(target_pass), (tp, hp, st, tree_block)),
    }
    if paths == 1:  # the spine never re-reads a path
        table.pop(f"head step, 1 paths x {depth - 1} tokens")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--tree", type=int, default=1, help="tree nodes beyond the depth")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--width", type=int, default=0, help="paths drafted per depth (0: top-k; 1: the spine)")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/bench_eagle3_tree_d5/round_cost.md")
    a = ap.parse_args()
    table = parts(a.depth, a.tree, a.top_k, a.width)
    for f, xs in table.values():  # compile
        jax.block_until_ready(f(*xs))
    times = {name: [] for name in table}
    for _ in range(a.repeats):
        for name, (f, xs) in table.items():
            calls = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*xs))
                calls.append(time.perf_counter() - t0)
            times[name].append(float(np.median(calls)) * 1e3)
    cmd = (f"python benchmarks/bench_eagle3_tree_cost.py --depth {a.depth} --tree {a.tree} --top-k {a.top_k} "
           f"--width {a.width} --calls {a.calls} --repeats {a.repeats} --out {a.out}")
    shape = f"d{a.depth} +{a.tree} k{a.top_k}" + (f" w{a.width}" if a.width else "")
    lines = [f"# One EAGLE-3 round, part by part: chain d{a.depth} vs tree {shape} "
             "(embedded pair, batch 1)", "", f"Command: `{cmd}`", "",
             "Each part a jitted program from the same state; median over repeats of the per-call median (min-max "
             "over repeats).", "", "| part | ms (min-max) |", "|---|---|"]
    for name, ms in times.items():
        lines.append(f"| {name} | {np.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f}) |")
    lines += ["", f"jax {jax.__version__} on {jax.devices()[0]}; {time.strftime('%Y-%m-%dT%H:%M:%S%z')}."]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
