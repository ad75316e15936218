"""`parse-jax eval` with parse against the same eval with target, at eval's defaults (batch 8, continuous batching,
schedule auto): 256 held-out problems of the embedded task as a JSONL file, each eval run as a user runs it (a fresh
process, after one untimed run of each: it fills the persistent compile cache with the programs that run ran, and
the setup figures with what it set up), alternating target and parse, wall time of each process. Accuracy must
match.

    python benchmarks/bench_eval_speed.py --n 256 --repeats 2 --out benchmarks/results/eval_speed

`--new-machine`: every eval process runs with caches of its own, empty at the start (`XDG_CACHE_HOME` in a
temporary folder: no compile cache, no executables, no setup figures), as on a machine that never ran parse-jax;
after the untimed runs, one longer parse eval (`--long` problems, another seed) runs untimed, a job whose gain pays
back PARSE's unmeasured setup, and the setup figures it leaves are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import parse_jax as pj
from parse_jax.harness.eval.results import summary_path
from parse_jax.harness.provenance import provenance
from parse_jax.utils import atomic, compile_cache


def run_eval(data: Path, mode: str, out: Path, env: dict | None = None) -> tuple[float, dict]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "parse_jax.cli", "eval", "--data", str(data), "--mode", mode,
                    "--out", str(out), "--no-progress"], check=True, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    return seconds, json.loads(summary_path(out).read_text())


def _setup_figures(cache: Path) -> dict:
    """The setup figures on record in an eval process's cache folder (paid, warm), by file."""
    return {f.name: {"seconds": (d := json.loads(f.read_text()))["seconds"], "warm_seconds": d.get("warm_seconds", {})}
            for f in sorted((cache / "parse-jax" / "profiles").glob("setup-*.json"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", default="benchmarks/results/eval_speed")
    ap.add_argument("--new-machine", action="store_true",
                    help="caches of the eval processes' own, empty at the start (see the module docstring)")
    ap.add_argument("--long", type=int, default=1024, help="with --new-machine: the longer parse eval's problems")
    args = ap.parse_args()
    if args.long != ap.get_default("long") and not args.new_machine:
        ap.error("--long: only with --new-machine")
    task = pj.load_task()
    work = Path(tempfile.mkdtemp(prefix="parse-jax-eval-speed-"))
    env = None
    if args.new_machine:  # every cache under a folder of its own (a compile cache moved or turned off: not here)
        env = {k: v for k, v in os.environ.items() if k not in (compile_cache.ENV_VAR, compile_cache.EXECUTABLES_VAR)}
        env["XDG_CACHE_HOME"] = str(work / "cache")

    def problems(n: int, seed: int) -> Path:
        path = work / f"problems_{n}_{seed}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p, "solution": s}) + "\n"
                                for p, s in task.problems(n, seed=seed, split="test")))
        return path

    data = problems(args.n, args.seed)
    warm_up = {}
    for mode in ("target", "parse"):  # warm the persistent compile cache
        s, summary = run_eval(data, mode, work / f"warm_{mode}.jsonl", env)
        warm_up[mode] = {"seconds": s, "accepted_per_pass": summary.get("accepted_per_pass")}
    if args.new_machine:
        s, summary = run_eval(problems(args.long, args.seed + 1), "parse", work / "long.jsonl", env)
        warm_up["long_parse"] = {"n": args.long, "seconds": s, "accepted_per_pass": summary.get("accepted_per_pass"),
                                 "setup_figures": _setup_figures(work / "cache")}
        print("long parse eval", round(s, 1), flush=True)
    seconds, runs = {"target": [], "parse": []}, {"target": [], "parse": []}
    for r in range(args.repeats):
        for mode in (("target", "parse") if r % 2 == 0 else ("parse", "target")):
            s, summary = run_eval(data, mode, work / f"{mode}_{r}.jsonl", env)
            seconds[mode].append(s)
            runs[mode].append(summary)
            print(mode, round(s, 1), summary["accuracy"], flush=True)
    med = {m: statistics.median(v) for m, v in seconds.items()}
    paired = [p / t for p, t in zip(seconds["parse"], seconds["target"])]
    # accuracy and tokens/s of each mode's median run (the lower middle one of an even count)
    summaries = {m: runs[m][v.index(statistics.median_low(v))] for m, v in seconds.items()}
    result = {"command": "python " + " ".join(sys.argv), "n": args.n, "seconds": seconds, "median_seconds": med,
              "accuracy": {m: summaries[m]["accuracy"] for m in med},
              "tokens_per_s": {m: summaries[m]["tokens_per_s"] for m in med},
              "parse_speedup_wall": med["target"] / med["parse"],
              # each repeat's parse run over its target run (run back to back): a machine whose speed drifts over
              # the runs moves both
              "paired_ratios": paired, "paired_ratio_median": statistics.median(paired),
              "generate_seconds": {m: [r["seconds"] for r in runs[m]] for m in runs},
              # None: the run verified nothing (it decoded plainly throughout)
              "accepted_per_pass": {m: [r.get("accepted_per_pass") for r in runs[m]] for m in runs},
              # the untimed runs: which verified nothing (None), and with --new-machine the longer parse eval; and
              # the setup figures the timed runs left (they loaded what they ran: measured warm figures)
              "warm_up": warm_up, "new_machine": args.new_machine,
              "setup_figures_after": _setup_figures(work / "cache") if args.new_machine else None,
              "provenance": provenance(None, args.seed)}
    start = (f"caches empty at the start, then warmed by untimed runs of each and a {args.long}-problem parse eval"
             if args.new_machine else "compile cache warm")
    lines = [f"# `parse-jax eval` at its defaults: parse vs target ({args.n} held-out problems, a process per run, "
             f"{start}, {args.repeats} runs each, alternating)", "", f"Command: `{result['command']}`", "",
             "| mode | wall seconds (median) | runs | generate calls' seconds | accuracy | tokens/s (generate calls, "
             "the median run) |", "|---|---|---|---|---|---|"]
    for m in med:
        lines.append(f"| {m} | {med[m]:.1f} | {', '.join(f'{x:.1f}' for x in seconds[m])} | "
                     f"{', '.join(f'{x:.1f}' for x in result['generate_seconds'][m])} | "
                     f"{100 * result['accuracy'][m]:.1f}% | {result['tokens_per_s'][m]:.0f} |")
    lines.append(f"\nparse finishes in {med['parse'] / med['target']:.2f} of target's wall time (medians); each "
                 f"repeat's parse run over its target run: {', '.join(f'{x:.2f}' for x in paired)} (median "
                 f"{result['paired_ratio_median']:.2f}).")
    plain = [i for i, a in enumerate(result["accepted_per_pass"]["parse"]) if a is None]
    lines.append(f"parse runs that decoded plainly throughout (no verification pass): {plain or 'none'}.")

    def ran(run: dict) -> str:
        return "decoded plainly throughout" if run["accepted_per_pass"] is None else "ran PARSE"

    lines.append(f"The untimed parse run {ran(warm_up['parse'])}.")
    if args.new_machine:
        long = warm_up["long_parse"]
        lines.append(f"The {args.long}-problem parse eval (untimed, {long['seconds']:.1f} s) {ran(long)}; the "
                     f"setup figures it left (seconds): {json.dumps(long['setup_figures'])}; after the timed runs: "
                     f"{json.dumps(result['setup_figures_after'])}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "eval_speed.json", json.dumps(result, indent=1) + "\n")
    atomic.write_text(out / "eval_speed.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
