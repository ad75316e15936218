"""`schedule="auto"` against the target and fixed PARSE on the embedded pair, per batch size: held-out problems, the
modes interleaved per batch (rotating their order) in one process, after a warm-up per mode and batch size,
median over repeats of each mode's tokens/s ratio to the target's in the same repeat.

    python benchmarks/bench_schedule.py --batches 1,4,8,16,64 --n 64 --repeats 3 --out benchmarks/results/schedule_auto

Writes schedule.json (every figure, the choices the auto engines made, provenance) and schedule.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.utils import atomic

MODES = {  # row -> (engine mode, schedule)
    "target": ("target", "fixed"),
    "parse (fixed)": ("parse", "fixed"),
    "parse (auto)": ("parse", "auto"),
    "parse+eagle3 (fixed)": ("parse+eagle3", "fixed"),
    "parse+eagle3 (auto)": ("parse+eagle3", "auto"),
}


def run_batch(engines, task, problems, batch, repeats, max_new):
    chunks = [problems[i:i + batch] for i in range(0, len(problems), batch)]
    names = list(MODES)
    for name in names:  # warm-up: compiles every program of this batch shape (bucket) for each mode
        mode, _ = MODES[name]
        engines[name].generate([p for p, _ in chunks[0]], mode=mode, max_new_tokens=max_new)
    per_repeat = {name: [] for name in names}
    correct = {name: 0 for name in names}
    choices = {name: {} for name in names}
    for rep in range(repeats):
        tokens = {name: 0 for name in names}
        seconds = {name: 0.0 for name in names}
        for c, chunk in enumerate(chunks):
            order = names[(c + rep) % len(names):] + names[:(c + rep) % len(names)]
            for name in order:
                mode, _ = MODES[name]
                t0 = time.perf_counter()
                res = engines[name].generate([p for p, _ in chunk], mode=mode, max_new_tokens=max_new)
                seconds[name] += time.perf_counter() - t0
                tokens[name] += res.stats["new_tokens"]
                for s in res.stats.get("schedule", []):
                    choices[name][s["ran"]] = choices[name].get(s["ran"], 0) + 1
                if rep == 0:
                    correct[name] += sum(task.grade(p, text) for (p, _), text in zip(chunk, res.texts))
        for name in names:
            per_repeat[name].append(tokens[name] / seconds[name])
    out = {}
    for name in names:
        ratios = [a / b for a, b in zip(per_repeat[name], per_repeat["target"])]
        out[name] = {"tokens_per_s": statistics.median(per_repeat[name]),
                     "speedup_vs_target": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
                     "accuracy": correct[name] / len(problems), "ran": choices[name]}
    return out


def markdown(result: dict) -> str:
    names = list(MODES)
    lines = [f"# schedule=auto vs fixed PARSE and the target (embedded pair, {result['n']} held-out problems per "
             f"batch size, {result['repeats']} repeats, max_new_tokens {result['max_new_tokens']})", "",
             f"Command: `{result['command']}`", "",
             "| batch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for b, rows in result["batches"].items():
        cells = []
        for name in names:
            r = rows[name]
            cell = f"{r['tokens_per_s']:.0f} tok/s" if name == "target" else f"{r['speedup_vs_target']:.2f}x"
            cells.append(f"{cell}, acc {100 * r['accuracy']:.0f}%")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += ["", "What the auto engines ran (batches per choice, all repeats): " + "; ".join(
        f"b{b} {name}: {rows[name]['ran']}" for b, rows in result["batches"].items()
        for name in names if "auto" in name)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8,16,64")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default="benchmarks/results/schedule_auto")
    args = ap.parse_args()
    target, draft = pj.load_pair()
    task = pj.load_task()
    problems = task.problems(args.n, seed=args.seed, split="test")
    engines = {name: pj.ParseEngine(target, draft, pj.ParseConfig(schedule=schedule))
               for name, (_, schedule) in MODES.items()}
    result = {"n": args.n, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
              "command": "python " + " ".join(sys.argv), "provenance": provenance(None, args.seed), "batches": {}}
    for b in (int(x) for x in args.batches.split(",")):
        result["batches"][str(b)] = run_batch(engines, task, problems, b, args.repeats, args.max_new_tokens)
        print(b, json.dumps({k: round(v["speedup_vs_target"], 3) for k, v in result["batches"][str(b)].items()}),
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "schedule.json", json.dumps(result, indent=1) + "\n")
    atomic.write_text(out / "schedule.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
