"""After the warm-up change (calls again while an auto engine explores or compiles): the default config against the
target at one batch size, through `harness.runs.measure` (same protocol as bench_schedule.py), reporting the
programs compiled inside the timed calls.

    python benchmarks/check_warmup_b64.py --batch 64 --n 48 --repeats 3 [--modes parse,parse+eagle3] --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_schedule import runner  # benchmarks/ is on sys.path when run as a script

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.harness.runs import RunSettings, measure
from parse_jax.utils import atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--modes", default="parse,parse+eagle3", help="default-config modes run against the target")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target, draft = pj.load_pair()
    task = pj.load_task()
    problems = task.problems(args.n, seed=args.seed, split="test")
    modes = ["target", *[m for m in args.modes.split(",") if m and m != "target"]]
    engines = {m: pj.ParseEngine(target, draft, pj.ParseConfig()) for m in modes}
    runners = {m: runner(e, m) for m, e in engines.items()}
    settings = RunSettings(n=args.n, max_new_tokens=args.max_new_tokens, batch_size=args.batch, repeats=args.repeats,
                           seed=args.seed, progress=False)
    rows = measure(runners, task, problems, settings)
    keep = ("tokens_per_s", "speedup_vs_target", "speedup_all", "accuracy", "compiles_in_timing", "schedule_ran")
    result = {"command": "python " + " ".join(sys.argv), "provenance": provenance(None, args.seed),
              "batch": args.batch, "rows": {m: {k: r[k] for k in keep} for m, r in rows.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "warmup_check.json", json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["rows"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
