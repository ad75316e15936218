"""Continuous batching against fixed chunks, over many prompts at B rows in flight: the target alone and multi-round
parse (schedule fixed, so that parse runs PARSE), on held-out problems of the embedded pair. Each runner takes every
prompt in one call: the continuous ones keep B slots busy (`ParseEngine.generate(..., max_batch=B)`), the chunked
ones run `generate` on chunks of B one after another. Interleaved by rotating the order each repeat, after a
warm-up; median over repeats of tokens/s ratios against the target in chunks.

    python benchmarks/bench_continuous.py --n 256 --batch 16 --repeats 3 --out benchmarks/results/continuous_b16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.harness.runs import RunSettings, measure
from parse_jax.runtime.requests import merge_results
from parse_jax.tasks.arith import PRESETS
from parse_jax.utils import atomic


def continuous(engine, mode):
    return lambda prompts, max_new, seed, max_batch: engine.generate(prompts, mode=mode, max_new_tokens=max_new,
                                                                     seed=seed, max_batch=max_batch)


def chunked(engine, mode):
    def run(prompts, max_new, seed, max_batch):
        parts = [engine.generate(prompts[i:i + max_batch], mode=mode, max_new_tokens=max_new, seed=seed)
                 for i in range(0, len(prompts), max_batch)]
        return merge_results(parts)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--task", default="default", choices=sorted(PRESETS),
                    help="task preset (the default task's answers all have one length: fixed chunks then waste "
                    "nothing; `medium` mixes 3- and 4-step problems)")
    ap.add_argument("--out", default="benchmarks/results/continuous_b16")
    args = ap.parse_args()
    target, draft = pj.load_pair()
    task = pj.load_task(args.task)
    problems = task.problems(args.n, seed=args.seed, split="test")
    eng = pj.ParseEngine(target, draft, pj.ParseConfig(schedule="fixed"))
    runners = {"target (chunks)": chunked(eng, "target"), "target (continuous)": continuous(eng, "target"),
               "parse (chunks)": chunked(eng, "parse"), "parse (continuous)": continuous(eng, "parse")}
    settings = RunSettings(n=args.n, max_new_tokens=args.max_new_tokens, batch_size=args.batch,
                           repeats=args.repeats, seed=args.seed, progress=False, batching="continuous")
    rows = measure(runners, task, problems, settings, baseline="target (chunks)")
    result = {"n": args.n, "batch": args.batch, "task": args.task, "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens,
              "command": "python " + " ".join(sys.argv), "provenance": provenance(None, args.seed), "rows": rows}
    lines = [f"# Continuous batching vs fixed chunks ({args.n} held-out problems, {args.batch} rows in flight, "
             f"{args.repeats} repeats, max_new_tokens {args.max_new_tokens}, embedded pair, task {args.task})", "",
             f"Command: `{result['command']}`", "",
             "| run | tokens/s | vs target in chunks (min-max) | accuracy | compiles in timing |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['speedup_vs_target']:.2f}x "
                     f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {100 * r['accuracy']:.1f}% | "
                     f"{r['compiles_in_timing']} |")
    for mode in ("target", "parse"):
        a, b = rows[f"{mode} (continuous)"]["tokens_per_s_all"], rows[f"{mode} (chunks)"]["tokens_per_s_all"]
        ratios = sorted(x / y for x, y in zip(a, b))
        lines.append(f"\n{mode}: continuous / chunks = {ratios[len(ratios) // 2]:.2f}x (per repeat: "
                     + ", ".join(f"{x:.2f}" for x in ratios) + ")")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "continuous.json", json.dumps(result, indent=1) + "\n")
    atomic.write_text(out / "continuous.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
