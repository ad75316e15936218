"""Tokens/s per mode against batch size on the embedded pair: the default config (`schedule="auto"`) against fixed
PARSE and the target, each run by `harness.runs.measure` (held-out problems, a warm-up per mode and batch size, the
modes interleaved by rotating their order each repeat, median over repeats of each mode's tokens/s ratio to the
target's in the same repeat), with continuous batching (`--batching continuous`: every prompt in one call,
`batch` rows in flight) or fixed chunks.

    python benchmarks/bench_schedule.py --batches 1,4,8,16,64 --n 64 --repeats 3 --out benchmarks/results/schedule_auto

Writes schedule.json (every figure, what the auto engines ran, provenance), schedule.md and speedup_vs_batch.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.harness.runs import RunSettings, measure, ran_in_repeats
from parse_jax.settings import BATCHING
from parse_jax.utils import atomic

ROWS = {  # row -> (engine mode, schedule); "target" is the baseline
    "target": ("target", "fixed"),
    "parse (default: auto)": ("parse", "auto"),
    "parse (fixed)": ("parse", "fixed"),
    "parse+eagle3 (default: auto)": ("parse+eagle3", "auto"),
    "parse+eagle3 (fixed)": ("parse+eagle3", "fixed"),
    "sd (default: auto)": ("sd", "auto"),
    "eagle3 (default: auto)": ("eagle3", "auto"),
    "sequential (default: auto)": ("sequential", "auto"),
}


def runner(engine: pj.ParseEngine, mode: str):
    return lambda prompts, max_new, seed, max_batch=None: engine.generate(
        prompts, mode=mode, max_new_tokens=max_new, seed=seed, max_batch=max_batch)


def markdown(result: dict) -> str:
    names = list(ROWS)
    lines = [f"# Tokens/s per mode against batch size (embedded pair, {result['n']} held-out problems per batch "
             f"size, {result['repeats']} repeats, max_new_tokens {result['max_new_tokens']}, "
             f"{result['batching']} batching)", "", f"Command: `{result['command']}`", "",
             "Cells: tokens/s, speed-up over the target (median of per-repeat ratios, min-max), accuracy.", "",
             "| batch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for b, rows in result["batches"].items():
        cells = []
        for name in names:
            r = rows[name]
            ratio = "" if name == "target" else (f", {r['speedup_vs_target']:.2f}x "
                                                 f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f})")
            cells.append(f"{r['tokens_per_s']:.0f} tok/s{ratio}, acc {100 * r['accuracy']:.0f}%")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += ["", "What the auto engines ran in the timed repeats (decisions per choice, summed over the repeats; a "
                  "served run decides once, and once more per window it explores or measures again): " + "; ".join(
                      f"b{b} {name}: {ran_in_repeats(rows[name])}" for b, rows in result["batches"].items()
                      for name in names if "auto" in name),
              "", "Programs compiled inside the timed runs: " + "; ".join(
                  f"b{b}: {sum(r['compiles_in_timing'] for r in rows.values())}"
                  for b, rows in result["batches"].items())]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [int(b) for b in result["batches"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in ROWS:
        if name == "target":
            continue
        ys = [result["batches"][str(b)][name]["speedup_vs_target"] for b in batches]
        ax.plot(batches, ys, marker="o", label=name, linestyle="-" if "auto" in name else "--")
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.text(batches[-1], 1.02, "target", ha="right", va="bottom", color="gray", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (rows in flight)")
    ax.set_ylabel("speed-up over the target (tokens/s)")
    ax.set_title("Speed-up against batch size, embedded pair, CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8,16,64")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--batching", choices=BATCHING, default="continuous")
    ap.add_argument("--out", default="benchmarks/results/schedule_auto")
    args = ap.parse_args()
    target, draft = pj.load_pair()
    task = pj.load_task()
    problems = task.problems(args.n, seed=args.seed, split="test")
    engines = {name: pj.ParseEngine(target, draft, pj.ParseConfig(schedule=schedule))
               for name, (_, schedule) in ROWS.items()}
    runners = {name: runner(engines[name], mode) for name, (mode, _) in ROWS.items()}
    result = {"n": args.n, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "batching": args.batching,
              "command": "python " + " ".join(sys.argv), "provenance": provenance(None, args.seed), "batches": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "schedule.partial.json"
    if partial.exists():  # resume: batch sizes an interrupted run of the same settings finished
        done = json.loads(partial.read_text())
        if all(done.get(k) == result[k] for k in ("n", "repeats", "max_new_tokens", "batching")):
            result["batches"] = done["batches"]
    for b in (int(x) for x in args.batches.split(",")):
        if str(b) in result["batches"]:
            continue
        settings = RunSettings(n=args.n, max_new_tokens=args.max_new_tokens, batch_size=b, repeats=args.repeats,
                               seed=args.seed, progress=False, batching=args.batching)
        result["batches"][str(b)] = measure(runners, task, problems, settings)
        print(b, json.dumps({k: round(v["speedup_vs_target"], 3) for k, v in result["batches"][str(b)].items()}),
              flush=True)
        atomic.write_text(partial, json.dumps(result, indent=1) + "\n")  # progress so far
        # the programs of this batch size are not met again: free them (each compiled CPU program holds its own
        # memory mappings; a process that keeps them all ran out of them, LLVM "Cannot allocate memory", at batch 4)
        jax.clear_caches()
    atomic.write_text(out / "schedule.json", json.dumps(result, indent=1) + "\n")
    atomic.write_text(out / "schedule.md", markdown(result))
    plot(result, out / "speedup_vs_batch.png")
    partial.unlink(missing_ok=True)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
