"""How long lowering a run for TPU (or CUDA) takes on this machine: the embedded pair's programs per mode, lowered
with `ParseEngine.lower` from shapes (no weights), each mode in a fresh trace cache.

    python benchmarks/lower_pair.py [--platform tpu] [--chip v5e] [--modes parse,all]
        [--out benchmarks/results/lower_pair]

Writes lower_pair.json (seconds per mode and program, custom calls) and lower_pair.md.
"""

from __future__ import annotations

import argparse
import os
import platform as host
import sys
import time
from pathlib import Path

import jax

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.lowering.launches import LOWERED_MODES
from parse_jax.lowering.sources import shape_head, shape_pair
from parse_jax.utils import atomic


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", default="tpu")
    p.add_argument("--chip", default=None)
    p.add_argument("--modes", default="parse," + ",".join(m for m in LOWERED_MODES if m != "parse"))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results/lower_pair")
    args = p.parse_args()
    t0 = time.perf_counter()
    target, draft = shape_pair()
    target.eagle3 = shape_head(target.config)
    engine = ParseEngine(target, draft, ParseConfig())
    setup = time.perf_counter() - t0
    rows = []
    for mode in args.modes.split(","):
        jax.clear_caches()  # every mode traced from nothing, as a fresh `parse-jax lower` process would
        t, cpu = time.perf_counter(), time.process_time()
        run = engine.lower(mode, args.batch_size, args.max_new_tokens, platform=args.platform, chip=args.chip)
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
        rows.append({"mode": mode, "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
                     "lowered": not run.failed,
                     "programs": [{"name": q.name, "seconds": round(q.seconds, 2), "custom_calls": q.custom_calls}
                                  for q in run.programs]})
        print(f"{mode}: {seconds:.1f} s ({cpu:.1f} s CPU), {len(run.programs)} programs, failed: "
              f"{run.failed or 'none'}", flush=True)
    command = "python " + " ".join(sys.argv)
    result = {"command": command, "platform": args.platform, "chip": run.chip.name, "jax": jax.__version__,
              "host": host.processor() or host.machine(), "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "setup_seconds": round(setup, 2), "modes": rows}
    out = Path(args.out)
    atomic.write_json(out / "lower_pair.json", result)
    lines = [f"# Lowering the embedded pair for {args.platform} {run.chip.name} on this CPU", "",
             f"`{command}` (jax {jax.__version__}; models as shapes, loaded in {setup:.1f} s; each mode traced from "
             "an empty cache; wall seconds on a shared machine, and this process's CPU seconds)", "",
             "| mode | programs | wall s | CPU s |", "|---|---|---|---|"]
    lines += [f"| {r['mode']} | {len(r['programs'])} | {r['seconds']} | {r['cpu_seconds']} |" for r in rows]
    atomic.write_text(out / "lower_pair.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
