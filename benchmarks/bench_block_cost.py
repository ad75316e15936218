"""What a block of T new tokens costs the embedded pair's models over their KV caches, relative to one token.

Token-level speculation (sd, EAGLE-3) trades T one-token steps for one pass over a block of gamma + 1 tokens, and a
PARSE verification block holds prompt + draft + suffix copies (about 48 tokens on the embedded task): either pays
only when that pass costs much less than T target steps. The draft's and the EAGLE-3 head's one-token steps are the
price of drafting. Each pass runs 50 times inside one jitted `fori_loop` (no host work per pass) over a cache of
128 slots holding 40 tokens. Median of repeats.

    python benchmarks/bench_block_cost.py [--models target,draft,eagle3] [--batches 1,16] [--blocks 1,2,6,16,48]
        [--out benchmarks/results/block_cost]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from bench_decode import median_seconds  # benchmarks/ is on sys.path when run as a script

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.models.cache import KVCache
from parse_jax.models.decoder import Decoder, causal_metadata
from parse_jax.speculation.eagle3 import Eagle3Head, lm_head

PASSES = 50


def block_seconds(model, batch: int, t: int, repeats: int) -> float:
    """One decoder pass over T new tokens (LM head included)."""
    module = Decoder(model.config, model.attention_impl)

    def apply(params, tokens, positions, cache, limit, group):
        logits, written, _ = module.apply({"params": params}, tokens, positions, cache, limit, group)
        return logits, written

    return _timed(apply, model.params, model.config, batch, t, repeats)


def head_block_seconds(target, batch: int, t: int, repeats: int) -> float:
    """One EAGLE-3 head pass over T tokens (its layer and the target's LM head), as a drafting step runs it."""
    head = target.eagle3
    module = Eagle3Head(head.config.layer, target.attention_impl)

    def apply(params, tokens, positions, cache, limit, group):
        embeds = params["target"]["embed_tokens"]["embedding"][tokens]
        # the hidden state input: any [B, T, d] array costs the same as the head's own previous output
        _, normed, written = module.apply({"params": params["head"]}, embeds, embeds, positions, cache, limit, group)
        return lm_head(params["target"], target.config, normed), written

    return _timed(apply, {"head": head.params, "target": target.params}, head.config.layer, batch, t, repeats)


def _timed(apply, params, cfg, batch: int, t: int, repeats: int) -> float:
    @jax.jit
    def run(params, cache, tokens):
        limit, group = causal_metadata(batch, t)
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]

        def body(_, c):
            logits, written = apply(params, tokens, positions, c, limit, group)
            # keep the logits live (the LM head is part of every pass); the cache length is not committed
            return written.replace(lengths=c.lengths, k=(written.k[0] + 0 * logits[0, 0, 0], *written.k[1:]))

        return jax.lax.fori_loop(0, PASSES, body, cache)

    cache = KVCache.init(cfg, batch, 128).commit(40)
    tokens = jnp.ones((batch, t), jnp.int32)
    return median_seconds(lambda: jax.block_until_ready(run(params, cache, tokens)), repeats) / PASSES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="target,draft,eagle3", help="any of target, draft, eagle3 (the head)")
    ap.add_argument("--pair", default=None, help="a pair folder (default: the embedded pair)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--blocks", default="1,2,6,16,48")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/block_cost")
    ap.add_argument("--plot", default=None, help="also draw the cost regime into this PNG (e.g. OUT.png)")
    a = ap.parse_args()
    target, draft = pj.load_pair(a.pair)
    timers = {"target": lambda b, t: block_seconds(target, b, t, a.repeats),
              "draft": lambda b, t: block_seconds(draft, b, t, a.repeats),
              "eagle3": lambda b, t: head_block_seconds(target, b, t, a.repeats)}
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in timers]
    if unknown or ("eagle3" in models and getattr(target, "eagle3", None) is None):
        sys.exit(f"--models: unknown or unavailable {unknown or ['eagle3']}; available: {', '.join(timers)}")
    rows = []
    target_step: dict[int, float] = {}
    for m in models:
        for b in (int(x) for x in a.batches.split(",")):
            one = None
            for t in (int(x) for x in a.blocks.split(",")):
                s = timers[m](b, t)
                one = s if t == 1 else one
                if m == "target" and t == 1:
                    target_step[b] = s
                rows.append({"model": m, "batch": b, "block": t, "us": s * 1e6,
                             "vs_one_token": s / one if one else None,
                             "vs_target_step": s / target_step[b] if b in target_step else None})
                print(f"{m:7s} batch {b:3d}  T={t:3d}  {s * 1e6:9.1f} us  "
                      f"{s / one if one else float('nan'):6.2f}x its T=1", flush=True)
    command = "python benchmarks/bench_block_cost.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows,
                                                    "provenance": provenance({"passes": PASSES}, 0)}, indent=2))
    lines = [f"# Block cost of the pair's models\n\nCommand: `{command}`\n",
             "| model | batch | block T | us per pass | vs its T=1 | vs target's T=1 |", "|---|---|---|---|---|---|"]

    def ratio(x):
        return "-" if x is None else f"{x:.3f}x" if x < 0.1 else f"{x:.2f}x"

    lines += [f"| {r['model']} | {r['batch']} | {r['block']} | {r['us']:.1f} | {ratio(r['vs_one_token'])} | "
              f"{ratio(r['vs_target_step'])} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if a.plot:
        from parse_jax.harness.plots import block_cost_plot

        print(f"wrote {block_cost_plot(rows, a.plot)}")


if __name__ == "__main__":
    main()
