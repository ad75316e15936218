"""Multi-round against single-round PARSE at batch 1, prompt by prompt: each held-out prompt alone through both
(`schedule="fixed"`, the same mode), interleaved in alternating order, median of the repeats per prompt. Prints and
writes the total time of each over the prompts, their ratio, and the prompts grouped by what the rounds did (passes,
accepted draft tokens), so that where multi-round gains and where it loses can be read apart.

    python benchmarks/bench_rounds_b1.py --mode parse+eagle3 --n 48 --repeats 3 --out benchmarks/results/rounds_b1
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import parse_jax as pj
from parse_jax.harness.provenance import format_provenance, provenance
from parse_jax.utils import atomic

ROUNDS = ("single", "multi")
FIELDS = ("target_passes", "verify_passes", "accepted_tokens", "eagle3_accepted_tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="parse+eagle3", choices=("parse", "parse+eagle3"))
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/rounds_b1")
    args = ap.parse_args()
    target, draft = pj.load_pair()
    prompts = [p for p, _ in pj.load_task().problems(args.n, seed=args.seed, split="test")]
    engines = {r: pj.ParseEngine(target, draft, pj.ParseConfig(schedule="fixed", rounds=r)) for r in ROUNDS}

    def run(rounds: str, prompt: str):
        return engines[rounds].generate([prompt], mode=args.mode, max_new_tokens=args.max_new)

    for rounds in ROUNDS:  # set every program up before timing
        for prompt in prompts[:6]:
            run(rounds, prompt)
    seconds = {r: [[] for _ in prompts] for r in ROUNDS}
    stats: dict[str, list[dict]] = {r: [{} for _ in prompts] for r in ROUNDS}
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for rounds in (ROUNDS if (i + rep) % 2 else ROUNDS[::-1]):
                t0 = time.perf_counter()
                res = run(rounds, prompt)
                seconds[rounds][i].append(time.perf_counter() - t0)
                stats[rounds][i] = {k: res.stats.get(k) for k in FIELDS} | {"tokens": len(res.tokens[0])}
    med = {r: [statistics.median(x) for x in seconds[r]] for r in ROUNDS}
    total = {r: sum(med[r]) for r in ROUNDS}
    groups = collections.defaultdict(list)
    for i in range(len(prompts)):
        s, m = stats["single"][i], stats["multi"][i]
        groups[(s["target_passes"], s["accepted_tokens"], m["target_passes"], m["accepted_tokens"])].append(i)
    rows = []
    for (sp, sa, mp, ma), idx in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        ms, ss = (sum(med[r][i] for i in idx) for r in ("multi", "single"))
        rows.append({"prompts": len(idx), "single_passes": sp, "single_accepted": sa, "multi_passes": mp,
                     "multi_accepted": ma, "single_ms": 1e3 * ss / len(idx), "multi_ms": 1e3 * ms / len(idx),
                     "multi_over_single": ms / ss})
    result = {"command": "python " + " ".join(sys.argv), "mode": args.mode, "n": args.n, "max_new": args.max_new,
              "repeats": args.repeats, "total_seconds": total, "multi_over_single": total["multi"] / total["single"],
              "groups": rows, "seconds": seconds, "stats": stats, "provenance": provenance(None, args.seed)}
    lines = [f"# {args.mode}: multi-round against single-round at batch 1, prompt by prompt", "",
             f"Command: `{result['command']}`", "",
             f"{args.n} held-out problems (seed {args.seed}), each alone, {args.max_new} new tokens at most, "
             f"`schedule=\"fixed\"`, {args.repeats} repeats interleaved (alternating order), median per prompt.", "",
             f"Total over the prompts: single {total['single']:.3f} s, multi {total['multi']:.3f} s: "
             f"**multi / single = {result['multi_over_single']:.3f}**.", "",
             "| prompts | single: target passes, accepted | multi: target passes, accepted | single ms | multi ms "
             "| multi / single |", "|---|---|---|---|---|---|"]
    for g in rows:
        lines.append(f"| {g['prompts']} | {g['single_passes']}, {g['single_accepted']} | {g['multi_passes']}, "
                     f"{g['multi_accepted']} | {g['single_ms']:.2f} | {g['multi_ms']:.2f} | "
                     f"{g['multi_over_single']:.3f} |")
    lines.append("\n" + format_provenance(result["provenance"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "rounds_b1.json", json.dumps(result, indent=1) + "\n")
    atomic.write_text(out / "rounds_b1.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
