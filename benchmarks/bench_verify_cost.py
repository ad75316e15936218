"""What one PARSE verification pass costs the embedded target, against the passes it replaces.

A verification block of prompt + a 64-token draft + K suffix copies (K = 1, 4, 16, 32 prefixes spread evenly)
is timed against a plain causal prefill of prompt + draft and a one-token decode step; one sequential-baseline
pass (one real step of the task + suffix over the cached prompt) is timed too. Median of repeats, one process.

    python benchmarks/bench_verify_cost.py [--batch 16] [--repeats 20] [--out benchmarks/results/verify_cost]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from bench_decode import median_seconds  # benchmarks/ is on sys.path when run as a script
from host_reference import pack, verify_pass

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.runtime.programs import bucket
from parse_jax.train.evaluate import step_seconds
from parse_jax.verify.scoring import judge_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--draft-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/verify_cost")
    a = ap.parse_args()
    target, draft = pj.load_pair()
    task = pj.load_task()
    tok = target.tokenizer
    cfg = pj.ParseConfig()
    yes, no, shared = judge_ids(tok, cfg.judge_yes, cfg.judge_no)
    suffix = tok.encode(cfg.verify_suffix) + shared
    prompt, solution = task.problems(1, 0)[0]
    ctx = [tok.bos_id, *tok.encode(prompt)]
    one = tok.encode(solution)
    d = (one * (a.draft_tokens // len(one) + 1))[: a.draft_tokens]  # a draft of the asked length (cost only)
    natural = pj.ParseEngine(target, draft, cfg).boundaries(one)
    rows = []
    b = a.batch

    def run_block(blocks, length, k):
        cache = target.init_cache(b, bucket(length))
        out = verify_pass(target, cache, blocks, yes, no, bucket(length), k)
        np.asarray(out.scores)

    prefill_len = len(ctx) + len(d)
    plain = pack(0, ctx + d, [prefill_len], suffix[:1])  # one 1-token copy: the smallest block that is a pass
    t_prefill = median_seconds(lambda: run_block([plain] * b, plain.length, 1), a.repeats)
    t_step = step_seconds(target, b)
    for k in (1, 4, 16, 32):
        bounds = sorted(set(np.linspace(len(d) / k, len(d), k).round().astype(int).tolist()))
        blk = pack(0, ctx + d, [len(ctx) + x for x in bounds], suffix)
        kb = bucket(len(bounds), 1)
        t = median_seconds(lambda blk=blk, kb=kb: run_block([blk] * b, blk.length, kb), a.repeats)
        rows.append({"K": len(bounds), "block_tokens": blk.length, "bucket": bucket(blk.length), "seconds": t,
                     "vs_prefill": t / t_prefill, "vs_decode_step": t / t_step if t_step else None})
    seg = int(max(np.diff([0, *natural])))
    seq_blk = pack(len(ctx), one[:seg], [seg], suffix)
    t_seg = median_seconds(lambda: run_block([seq_blk] * b, seq_blk.length, 1), a.repeats)
    res = {"command": "python " + " ".join(sys.argv), "batch": b, "prefill_tokens": prefill_len,
           "prefill_s": t_prefill, "decode_step_s": t_step, "sequential_pass_s": t_seg,
           "sequential_passes": len(natural), "rows": rows, "provenance": provenance()}
    lines = [f"Embedded target, batch {b}, median of {a.repeats}: prefill of {prefill_len} tokens "
             f"{t_prefill * 1e3:.2f} ms; decode step {t_step * 1e3:.2f} ms; one sequential pass (segment + suffix) "
             f"{t_seg * 1e3:.2f} ms x {len(natural)} segments = {t_seg * len(natural) * 1e3:.2f} ms.", "",
             "| K | block tokens | ms | vs prefill | vs decode step |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['K']} | {r['block_tokens']} | {r['seconds'] * 1e3:.2f} | {r['vs_prefill']:.2f}x | "
                     f"{r['vs_decode_step']:.1f}x |")
    lines.append(f"\nCommand: `{res['command']}`")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
