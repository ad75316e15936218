"""The host's share of a request at batch 1 on the embedded pair: wall time of `ParseEngine.generate` minus the
time of the device programs it runs, over wall time, for target, parse (single round) and parse-multi.

The device time of a request is measured by running its program again on the same inputs, already placed on the
device, and waiting for the results (`jax.block_until_ready`): the program alone, with no encoding, validation,
padding, transfer to the host, decoding or statistics around it. Modes interleave per problem; each problem runs
every mode once per repeat; shares are over the sums (and the median per-request share is reported too).

    python benchmarks/bench_host_share.py [--n 100] [--repeats 3] [--out benchmarks/results/host_share]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

import parse_jax as pj
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.harness.provenance import provenance
from parse_jax.modes.parse import multi_launch, single_launch
from parse_jax.runtime.decode import generate_launch
from parse_jax.utils import atomic

MAX_NEW = 64


def launch_of(eng: ParseEngine, mode: str, prompt: str):
    """(program, device-placed args) that `eng.generate([prompt], mode)` runs."""
    req = eng.request([prompt], "target" if mode == "target" else "parse", MAX_NEW, 0.0, 0, 0, 1.0, None)
    if mode == "target":
        program, args = generate_launch(eng.target, req.ids, req.max_new, req.sampling, req.eos,
                                        eng.target.config.max_position_embeddings)
    else:
        launch = multi_launch(eng.context, req) if mode == "parse-multi" else single_launch(eng.context, req)
        program, args = launch.program, launch.args
    return program, jax.device_put(args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/host_share")
    args = ap.parse_args(argv)
    target, draft = pj.load_pair()
    task = pj.load_task()
    problems = [p for p, _ in task.problems(args.n, seed=12345)]
    engines = {"target": ParseEngine(target, draft, ParseConfig(rounds="single")),
               "parse": ParseEngine(target, draft, ParseConfig(rounds="single")),
               "parse-multi": ParseEngine(target, draft, ParseConfig(rounds="multi"))}
    modes = list(engines)
    wall = {m: [] for m in modes}
    device = {m: [] for m in modes}
    for m in modes:  # compile every bucket the problems use
        for p in problems[:4]:
            engines[m].generate([p], mode="target" if m == "target" else "parse", max_new_tokens=MAX_NEW)
            program, a = launch_of(engines[m], m, p)
            jax.block_until_ready(program(*a))
    for _ in range(args.repeats):
        for p in problems:
            for m in modes:
                eng = engines[m]
                t0 = time.perf_counter()
                eng.generate([p], mode="target" if m == "target" else "parse", max_new_tokens=MAX_NEW)
                wall[m].append(time.perf_counter() - t0)
                program, a = launch_of(eng, m, p)
                t0 = time.perf_counter()
                jax.block_until_ready(program(*a))
                device[m].append(time.perf_counter() - t0)
    rows = {}
    for m in modes:
        w, d = np.array(wall[m]), np.array(device[m])
        rows[m] = {"wall_ms_per_request": 1e3 * float(w.mean()), "device_ms_per_request": 1e3 * float(d.mean()),
                   "host_share": float(1 - d.sum() / w.sum()),
                   "median_host_share": float(np.median(1 - d / w)), "requests": int(len(w))}
    command = "python benchmarks/bench_host_share.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command.strip(), "max_new_tokens": MAX_NEW, "modes": rows,
              "provenance": provenance({"n": args.n, "repeats": args.repeats})}
    lines = ["# Host share of a request, batch 1, embedded pair", "", f"Command: `{result['command']}`", "",
             "Wall: `ParseEngine.generate` for one prompt. Device: the same request's program run again on its "
             "inputs already on the device (`block_until_ready`). Host share = 1 - device / wall over all requests.",
             "", "| mode | wall ms / request | device ms / request | host share | median per request |",
             "|---|---|---|---|---|"]
    for m, r in rows.items():
        lines.append(f"| {m} | {r['wall_ms_per_request']:.2f} | {r['device_ms_per_request']:.2f} | "
                     f"{100 * r['host_share']:.1f}% | {100 * r['median_host_share']:.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    atomic.write_json(out.with_suffix(".json"), result)
    atomic.write_text(out.with_suffix(".md"), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
