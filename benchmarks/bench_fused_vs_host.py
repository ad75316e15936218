"""The fused PARSE programs (parse_jax/modes/) against the host-orchestrated path they replaced, kept as
tests/parse_reference.py (numpy segmentation and packing, one program per phase, host steps between them), in the
same process, interleaved per batch, on the embedded pair: single round and multi round, with the target alone as
the baseline. Both paths give the same tokens (greedy float32; checked here on every problem), so the ratio is the
cost of the host round trips alone.

    python benchmarks/bench_fused_vs_host.py [--batch-size 16] [--n 320] [--repeats 3]
        [--out benchmarks/results/fused_vs_host_b16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the reference path) from a source checkout

import parse_jax as pj  # noqa: E402
from parse_jax.engine import ParseConfig, ParseEngine  # noqa: E402
from parse_jax.harness.provenance import provenance
from parse_jax.harness.runs import RunSettings, format_row, measure  # noqa: E402
from parse_jax.utils import atomic
from tests.parse_reference import ReferenceParse  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--n", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/fused_vs_host_b16")
    args = ap.parse_args(argv)
    target, draft = pj.load_pair()
    task = pj.load_task()
    problems = task.problems(args.n, 0)
    single = ParseEngine(target, draft, ParseConfig(rounds="single", schedule="fixed"))  # PARSE at every batch
    multi = ParseEngine(target, draft, ParseConfig(rounds="multi", schedule="fixed"))
    ref_single, ref_multi = ReferenceParse(single), ReferenceParse(multi)

    def run(obj, mode):
        return lambda prompts, max_new, seed, max_batch=None: obj.generate(prompts, mode=mode, max_new_tokens=max_new,
                                                                           seed=seed)

    runners = {"target": run(single, "target"), "parse (fused)": run(single, "parse"),
               "parse (host path)": run(ref_single, "parse"), "parse-multi (fused)": run(multi, "parse"),
               "parse-multi (host path)": run(ref_multi, "parse")}
    rows = measure(runners, task, problems, RunSettings(n=len(problems), max_new_tokens=args.max_new_tokens,
                                                        batch_size=args.batch_size, repeats=args.repeats,
                                                        batching="fixed"))  # the same batches for both paths
    prompts = [p for p, _ in problems]
    same = {}
    for fused, host, eng, ref in (("parse (fused)", "parse (host path)", single, ref_single),
                                  ("parse-multi (fused)", "parse-multi (host path)", multi, ref_multi)):
        a = [t for i in range(0, len(prompts), args.batch_size)
             for t in eng.generate(prompts[i:i + args.batch_size], mode="parse",
                                   max_new_tokens=args.max_new_tokens).tokens]
        b = [t for i in range(0, len(prompts), args.batch_size)
             for t in ref.generate(prompts[i:i + args.batch_size], mode="parse",
                                   max_new_tokens=args.max_new_tokens).tokens]
        same[fused] = float(np.mean([x == y for x, y in zip(a, b)]))
        rows[fused]["fused_over_host"] = float(np.median(np.array(rows[fused]["tokens_per_s_all"])
                                                         / np.array(rows[host]["tokens_per_s_all"])))
    command = "python benchmarks/bench_fused_vs_host.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command.strip(), "modes": rows, "identical_outputs": same, **vars(args),
              "provenance": provenance({"script": "bench_fused_vs_host", **vars(args)}, 0)}
    lines = [f"# Fused PARSE programs vs the host-orchestrated path (batch {args.batch_size})", "",
             f"`{result['command']}`", "",
             f"{args.n} problems of the embedded task, batch {args.batch_size}, {args.repeats} repeats interleaved, "
             f"greedy, at most {args.max_new_tokens} new tokens; speed-ups are medians of per-repeat ratios.", "",
             "| mode | tok/s | speed-up vs target (min-max) | accuracy (95% CI) | accepted / pass | "
             "target passes / 100 tok |", "|---|---|---|---|---|---|"]
    lines += [format_row(name, r) for name, r in rows.items()]
    lines += [""] + [f"- {name} / host path: {rows[name]['fused_over_host']:.3f}x tokens/s; identical outputs on "
                     f"{100 * same[name]:.1f}% of problems" for name in same]
    out = Path(args.out)
    atomic.write_json(out.with_suffix(".json"), result)
    atomic.write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
