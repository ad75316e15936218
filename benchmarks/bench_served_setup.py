"""The first call of a served run in a fresh process against its second (same shapes, nothing to set up).

As a user meets it: `ParseEngine.generate(prompts, max_batch=8)` over held-out problems, schedule fixed, the
persistent compile cache warm. Reported per mode: the first call's wall seconds, the setup jax reports in it
(tracing, lowering, loading), the programs the process set up, and the second call's seconds. With `--before DIR`
(a checkout of an earlier commit), each mode runs there too, interleaved, each run in a process of its own; with
`--executables`, each mode runs with the executable cache (runtime/executables) too, beside jax's compile cache alone.

    git worktree add /tmp/before COMMIT
    python benchmarks/bench_served_setup.py --n 64 --repeats 2 --before /tmp/before \
        --out benchmarks/results/served_setup
    python benchmarks/bench_served_setup.py --n 64 --repeats 2 --executables --out benchmarks/results/executables
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
from pathlib import Path

from parse_jax.harness.provenance import provenance
from parse_jax.utils import atomic

MODES = (("target", "single"), ("parse", "single"), ("parse", "multi"),
         ("parse+eagle3", "single"))

CHILD = r"""
import json, sys, time
from parse_jax.utils import compile_cache
compile_cache.enable(sys.argv[1])
if sys.argv[5] == "on":
    from parse_jax.runtime import executables
    executables.use(sys.argv[1] + "/" + executables.SUBFOLDER)
import parse_jax as pj
from parse_jax.runtime.programs import _PROGRAMS, setup_split
mode, rounds, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
task = pj.load_task()
prompts = [p for p, _ in task.problems(n, seed=17, split="test")]
target, draft = pj.load_pair()
eng = pj.ParseEngine(target, draft, pj.ParseConfig(schedule="fixed", rounds=rounds))
out = {}
for call in ("first", "second"):
    s0, t0 = setup_split().seconds, time.perf_counter()
    res = eng.generate(prompts, mode=mode, max_new_tokens=256, max_batch=8)
    out[call] = {"seconds": time.perf_counter() - t0, "setup": setup_split().seconds - s0}
out["programs"] = sum(p._cache_size() for p in _PROGRAMS)
out["tokens"] = res.tokens
print("RESULT " + json.dumps(out))
"""


def run(code: Path, cache: Path, mode: str, rounds: str, n: int, exe: str = "off") -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(cache), mode, rounds, str(n), exe], env=env,
                          capture_output=True, text=True, cwd=code)
    if proc.returncode:
        raise SystemExit(f"{mode}-{rounds} in {code} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="a checkout of the earlier code to run interleaved")
    ap.add_argument("--executables", action="store_true", help="each mode with the executable cache too")
    ap.add_argument("--out", default="benchmarks/results/served_setup")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    codes = {"now": (here, "off"), **({"before": (Path(args.before).resolve(), "off")} if args.before else {}),
             **({"executables": (here, "on")} if args.executables else {})}
    cache = Path(tempfile.mkdtemp(prefix="parse-jax-served-setup-"))
    rows = {}
    for mode, rounds in MODES:
        name = f"{mode}-{rounds}"
        for code, exe in codes.values():  # untimed: fills the compile cache with this code's programs
            run(code, cache, mode, rounds, args.n, exe)
        runs = {label: [] for label in codes}
        for r in range(args.repeats):
            for label in (list(codes) if r % 2 == 0 else list(codes)[::-1]):
                code, exe = codes[label]
                runs[label].append(run(code, cache, mode, rounds, args.n, exe))
        if any(got[0]["tokens"] != runs["now"][0]["tokens"] for got in runs.values()):
            raise SystemExit(f"{name}: {' and '.join(runs)} wrote different tokens")
        rows[name] = {label: {"first_seconds": statistics.median(x["first"]["seconds"] for x in got),
                              "first_setup": statistics.median(x["first"]["setup"] for x in got),
                              "second_seconds": statistics.median(x["second"]["seconds"] for x in got),
                              "programs": got[0]["programs"],
                              "first_runs": [round(x["first"]["seconds"], 2) for x in got]}
                      for label, got in runs.items()}
        print(name, json.dumps(rows[name]), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    before = None
    if args.before:
        before = subprocess.run(["git", "-C", args.before, "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    result = {"command": "python " + " ".join(sys.argv), "n": args.n, "repeats": args.repeats, "rows": rows,
              "before_commit": before, "provenance": provenance(None, 17)}
    lines = [f"# First call of a served run in a fresh process ({args.n} held-out problems, max_batch 8, "
             f"256 new tokens, schedule fixed, compile cache warm; median of {args.repeats} processes)", "",
             f"Command: `{result['command']}`", "",
             "| mode | code | first call s | setup in it s | second call s | programs set up |",
             "|---|---|---|---|---|---|"]
    for name, by in rows.items():
        for label, x in by.items():
            lines.append(f"| {name} | {label} | {x['first_seconds']:.2f} | {x['first_setup']:.2f} | "
                         f"{x['second_seconds']:.2f} | {x['programs']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out / "served_setup.json", result)
    atomic.write_text(out / "served_setup.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
