"""What the executable cache adds to each call of a program whose executable is ready: a registered program
(`runtime.programs.register_program`, cache on) against plain `jax.jit` of the same function, in one process,
interleaved, on the arguments a PARSE program takes (the embedded pair's params, 105 leaves, and a state array).
The program does nothing, so the figure is dispatch alone. Run it with `PYTHONPATH` set to a checkout to time that
checkout's code.

    python benchmarks/bench_program_dispatch.py --out benchmarks/results/program_dispatch
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.runtime import executables
from parse_jax.runtime.programs import register_program
from parse_jax.utils import atomic


def _touch(target_params, draft_params, state, step):
    return state[0, 0, 0, 0] + step


def per_call_us(fn, args: tuple, calls: int) -> float:
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args).block_until_ready()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/program_dispatch")
    args = ap.parse_args()
    target, draft = pj.load_pair()
    call_args = (target.params, draft.params, jnp.zeros((8, 64, 12, 32)), jnp.int32(3))
    plain, program = jax.jit(_touch), register_program(jax.jit(_touch))
    executables.use(tempfile.mkdtemp(prefix="parse-jax-dispatch-"))
    times: dict[str, list[float]] = {"jit": [], "program": []}
    for _ in range(args.repeats):
        for name, fn in (("jit", plain), ("program", program)):
            times[name].append(per_call_us(fn, call_args, args.calls))
    extra = [p - j for j, p in zip(times["jit"], times["program"])]
    result = {"command": "python " + " ".join(sys.argv), "leaves": len(jax.tree.leaves(call_args)),
              "code": str(Path(executables.__file__).resolve().parents[2]),
              "median_us": {k: statistics.median(v) for k, v in times.items()},
              "extra_us_median": statistics.median(extra), "extra_us": extra,
              "provenance": provenance(None, 0)}
    lines = [f"# Per-call dispatch: a registered program with the executable cache on against jax.jit "
             f"({result['leaves']} argument leaves, {args.calls} calls x {args.repeats} repeats, interleaved)", "",
             f"Command: `{result['command']}` (code: {result['code']})", "",
             "| program | us per call (median) |", "|---|---|",
             f"| jax.jit | {result['median_us']['jit']:.1f} |",
             f"| registered, cache on | {result['median_us']['program']:.1f} |", "",
             f"Added per call: {result['extra_us_median']:.1f} us (median of the per-repeat differences; "
             f"{min(extra):.1f}-{max(extra):.1f})."]
    out = Path(args.out)  # atomic writes create the folder
    atomic.write_json(out / "program_dispatch.json", result)
    atomic.write_text(out / "program_dispatch.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
