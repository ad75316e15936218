"""What a block of T new tokens costs the embedded target over its KV cache, relative to one token (T = 1).

Token-level speculation (sd, EAGLE-3) trades T one-token steps for one pass over a block of gamma + 1 tokens; it
pays only when that pass costs much less than gamma + 1 steps. Each pass runs 50 times inside one jitted
`fori_loop` (no host work per pass) over a cache of 128 slots holding 40 tokens. Median of repeats.

    python benchmarks/bench_block_cost.py [--batches 1,16] [--blocks 1,2,6,16] [--out benchmarks/results/block_cost]
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
from parse_jax.bench import provenance
from parse_jax.models.cache import KVCache
from parse_jax.models.decoder import Decoder, causal_metadata

PASSES = 50


def block_seconds(model, batch: int, t: int, repeats: int) -> float:
    module = Decoder(model.config, model.attention_impl)

    @jax.jit
    def run(params, cache, tokens):
        limit, group = causal_metadata(batch, t)
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]

        def body(_, c):
            logits, written, _ = module.apply({"params": params}, tokens, positions, c, limit, group)
            # keep the logits live (the LM head is part of every pass); the cache length is not committed
            return written.replace(lengths=c.lengths, k=(written.k[0] + 0 * logits[0, 0, 0], *written.k[1:]))

        return jax.lax.fori_loop(0, PASSES, body, cache)

    cache = KVCache.init(model.config, batch, 128).commit(40)
    tokens = jnp.ones((batch, t), jnp.int32)
    return median_seconds(lambda: jax.block_until_ready(run(model.params, cache, tokens)), repeats) / PASSES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--blocks", default="1,2,6,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/block_cost")
    a = ap.parse_args()
    target, _ = pj.load_pair()
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        one = None
        for t in (int(x) for x in a.blocks.split(",")):
            s = block_seconds(target, b, t, a.repeats)
            one = s if t == 1 else one
            rows.append({"batch": b, "block": t, "us": s * 1e6, "vs_one_token": s / one if one else None})
            print(f"batch {b:3d}  T={t:3d}  {s * 1e6:9.1f} us  {s / one if one else float('nan'):6.2f}x T=1",
                  flush=True)
    command = "python benchmarks/bench_block_cost.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows,
                                                    "provenance": provenance({"passes": PASSES}, 0)}, indent=2))
    lines = [f"# Block cost of the embedded target\n\nCommand: `{command}`\n",
             "| batch | block T | us per pass | vs T=1 |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['block']} | {r['us']:.1f} | {r['vs_one_token']:.2f}x |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
