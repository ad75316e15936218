"""Which step ends a PARSE pass verifies, at batch 1 on the embedded pair: spread evenly (the default) against the
ends before the steps the draft is least sure of (`prefix_choice="confidence"`), where K caps the prefixes below
the step ends a draft has, and against the ends whose expected saving pays for their suffix copy at the cost
model's price (`prefix_choice="auto"`).

    python benchmarks/bench_prefix_choice.py [--n 100] [--repeats 3] [--prefixes 2,3] [--rounds multi]
        [--choices spread,confidence,auto] [--out benchmarks/results/prefix_choice_b1]

Every setting is `generate(mode="parse")` with `schedule="fixed"`, one held-out problem at a time, greedy; the
settings (and the target alone, the baseline) run interleaved, each repeat in turn, in one process, after an untimed
warm-up over every prompt (one prompt per length bucket left multi-round programs to compile inside the timing).
Figures: tokens/s (median over repeats) and its ratio to the target in the same repeat, accepted draft tokens per
verification, prefixes per verification, verification tokens, accuracy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import parse_jax as pj
from parse_jax.harness.provenance import provenance
from parse_jax.tasks.arith import PRESETS
from parse_jax.utils import atomic


def settings(prefixes: list[int], rounds: str, choices: list[str]) -> dict[str, pj.ParseConfig]:
    out = {}
    for k in prefixes:
        for choice in choices:
            out[f"K={k} {choice}"] = pj.ParseConfig(max_prefixes=k, prefix_choice=choice, rounds=rounds,
                                                    schedule="fixed")
    return out


def run_one(engine, mode: str, prompts: list[str], task, answers: list[str] | None, max_new: int) -> dict:
    totals = {"new_tokens": 0, "seconds": 0.0, "accepted": 0, "verifications": 0, "prefixes": 0,
              "verify_tokens": 0, "correct": 0}
    for p in prompts:
        t0 = time.perf_counter()
        r = engine.generate([p], mode=mode, max_new_tokens=max_new)
        totals["seconds"] += time.perf_counter() - t0
        s = r.stats
        totals["new_tokens"] += s["new_tokens"]
        totals["accepted"] += s.get("accepted_tokens", 0)
        totals["verifications"] += s.get("num_verifications", 0)
        totals["prefixes"] += sum(s.get("prefixes_per_request", [0]))
        totals["verify_tokens"] += s.get("verify_tokens", 0)
        if answers is not None:
            totals["correct"] += bool(task.grade(p, r.texts[0]))
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefixes", default="2,3")
    ap.add_argument("--rounds", choices=["multi", "single"], default="multi")
    ap.add_argument("--choices", default="spread,confidence,auto", help="prefix_choice values, comma-separated")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--task", default="default", choices=sorted(PRESETS),
                    help="task preset (medium: more steps than the pair was trained on, so drafts go wrong)")
    ap.add_argument("--out", default="benchmarks/results/prefix_choice_b1")
    args = ap.parse_args()
    target, draft = pj.load_pair()
    task = pj.load_task(args.task)
    problems = task.problems(args.n, seed=args.seed, split="test")
    prompts = [p for p, _ in problems]
    table = settings([int(x) for x in args.prefixes.split(",")], args.rounds, args.choices.split(","))
    engines = {"target": pj.ParseEngine(target, draft, pj.ParseConfig(schedule="fixed"))}
    engines.update({name: pj.ParseEngine(target, draft, cfg) for name, cfg in table.items()})
    for name, eng in engines.items():  # warm-up: every prompt once (multi-round programs vary with the budget left)
        run_one(eng, "target" if name == "target" else "parse", prompts, task, None, args.max_new)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            r = run_one(engines[name], "target" if name == "target" else "parse", prompts, task, [], args.max_new)
            runs[name].append(r)
            print(f"repeat {rep} {name}: {r['new_tokens'] / r['seconds']:.1f} tok/s, "
                  f"{r['accepted'] / max(r['verifications'], 1):.2f} accepted/verification", flush=True)
    rows = []
    for name, rs in runs.items():
        tps = [r["new_tokens"] / r["seconds"] for r in rs]
        ratio = [t / (b["new_tokens"] / b["seconds"]) for t, b in zip(tps, runs["target"])]
        r0 = rs[0]
        rows.append({"setting": name, "tokens_per_s": statistics.median(tps), "vs_target": statistics.median(ratio),
                     "vs_target_min": min(ratio), "vs_target_max": max(ratio),
                     "accepted_per_verification": r0["accepted"] / max(r0["verifications"], 1),
                     "prefixes_per_verification": r0["prefixes"] / max(r0["verifications"], 1),
                     "verify_tokens_per_verification": r0["verify_tokens"] / max(r0["verifications"], 1),
                     "accuracy": r0["correct"] / len(prompts)})
    cmd = (f"python benchmarks/bench_prefix_choice.py --n {args.n} --repeats {args.repeats} --prefixes "
           f"{args.prefixes} --rounds {args.rounds} --choices {args.choices} --max-new {args.max_new} "
           f"--seed {args.seed} --task {args.task} --out {args.out}")
    out = Path(args.out)
    atomic.write_json(out / "prefix_choice.json", {"command": cmd, "rows": rows, "runs": runs,
                                                   "provenance": provenance(None, args.seed)})
    versus = " vs ".join(args.choices.split(","))
    lines = [f"# Which step ends a pass verifies: {versus} (embedded pair, task {args.task}, batch 1, "
             f"{args.rounds} round)",
             "", f"Command: `{cmd}`", "",
             f"{args.n} held-out problems one at a time, greedy, schedule fixed; settings interleaved in one process, "
             f"{args.repeats} repeats; tok/s: median over repeats; vs target: median (min-max) of the per-repeat "
             "ratio; per-verification figures from the first repeat (every repeat writes the same tokens).", "",
             "| setting | tok/s | vs target | accepted / verification | prefixes / verification | "
             "block tokens / verification | accuracy |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['tokens_per_s']:.1f} | {r['vs_target']:.2f}x ({r['vs_target_min']:.2f}-"
                     f"{r['vs_target_max']:.2f}) | {r['accepted_per_verification']:.2f} | "
                     f"{r['prefixes_per_verification']:.2f} | {r['verify_tokens_per_verification']:.1f} | "
                     f"{100 * r['accuracy']:.1f}% |")
    atomic.write_text(out / "prefix_choice.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
