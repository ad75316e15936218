"""The cost model's predicted pass seconds against passes timed now, for the (batch, tokens per pass) pairs the
schedule prices on the embedded pair: decode steps (1 token), draft-length blocks and verification blocks, at the
batch sizes of bench_schedule. The prediction is what `schedule="auto"` uses (`pass_costs`: the cached profile
where one exists, else the roofline); each timing is the median of repeats of a jitted pass (compile excluded), as
`parse-jax profile` times them.

    python benchmarks/bench_cost_model.py --repeats 5 --runs 3 --out benchmarks/results/cost_model

Every pair is timed in each of `--runs` passes over the whole list (one after the other, a couple of minutes apart),
and the measured figure is their median: the spread between runs (max / min) is the machine's own noise, the floor
under any prediction (18 and 30 of 55 pairs more than 1.25x apart over 3 runs in two runs of 2026-12-05; 33 in
`benchmarks/results/cost_model/`, 2026-12-06).

Writes cost_model.json and cost_model.md (predicted / measured per pair, the runs' spread, and the share within 25%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.schedule.profile import _time_pass, pass_costs
from parse_jax.utils import atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8,16,64")
    ap.add_argument("--tokens", default="1,8,12,16,24,32,48,64,96,128,192")
    ap.add_argument("--cache", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="timings of every pair, one pass over the list each")
    ap.add_argument("--out", default="benchmarks/results/cost_model")
    args = ap.parse_args()
    if args.runs < 1 or args.repeats < 1:
        ap.error(f"--runs and --repeats must be >= 1, got {args.runs} and {args.repeats}")
    target, draft = pj.load_pair()
    costs = pass_costs(target, draft, head=target.eagle3)
    pairs = [(b, t) for b in map(int, args.batches.split(",")) for t in map(int, args.tokens.split(","))]
    # a cache at least as long as the block (as `profile_model` times it)
    runs = [[_time_pass(target, b, t, max(args.cache, t), args.repeats) for b, t in pairs] for _ in range(args.runs)]
    rows = []
    for i, (b, t) in enumerate(pairs):
        times = [run[i] for run in runs]
        measured = statistics.median(times)
        predicted = costs.seconds("target", b, t, max(args.cache, t))
        rows.append({"batch": b, "tokens": t, "cache": max(args.cache, t), "measured_s": measured, "runs_s": times,
                     "spread": max(times) / min(times), "predicted_s": predicted, "ratio": predicted / measured})
    noisy = sum(r["spread"] > 1.25 for r in rows)
    within = sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
    result = {"command": "python " + " ".join(sys.argv), "sources": costs.sources, "rows": rows,
              "within_25pct": within, "pairs": len(rows), "runs": args.runs, "runs_over_25pct_apart": noisy,
              "provenance": provenance(None, 0)}
    lines = [f"# Predicted vs measured target pass seconds (cache {args.cache}, {args.repeats} repeats, "
             f"{args.runs} runs)", "",
             f"Command: `{result['command']}`", "", f"Cost sources: {costs.sources}", "",
             "| batch | tokens | measured ms | runs max / min | predicted ms | predicted / measured |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['tokens']} | {1e3 * r['measured_s']:.2f} | {r['spread']:.2f} | "
              f"{1e3 * r['predicted_s']:.2f} | {r['ratio']:.2f} |" for r in rows]
    lines += ["", f"Within 25% (|predicted / measured - 1| <= 0.25): {within} of {len(rows)} pairs. The machine "
              f"against itself: {noisy} of {len(rows)} pairs timed more than 1.25x apart (max / min) over its "
              f"{args.runs} runs."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "cost_model.json", json.dumps(result, indent=1) + "\n")
    atomic.write_text(out / "cost_model.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
