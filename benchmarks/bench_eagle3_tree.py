"""EAGLE-3 chain vs trees on the embedded pair at batch 1: accepted draft tokens per target pass and tokens/s.

    python benchmarks/bench_eagle3_tree.py [--n 60] [--repeats 3] [--depth 5] [--max-new 32]
        [--trees 4:2,8:2,8:4] [--out benchmarks/results/bench_eagle3_tree]

Each setting is `eagle3` greedy on the same held-out problems of the embedded task, one request at a time; the
settings run interleaved (every setting once per repeat in a seeded shuffled order, Python's garbage collected
before each; repeats in turn) in one process, after an untimed warm-up
call per program shape each, so compilation is not counted. A tree `NODES:K` is depth `--depth`, `--depth + NODES`
nodes, the K most likely expanded per depth; `NODES:K:W` drafts W paths per depth (1: the chain's own nodes, each
with its K - 1 likeliest siblings as leaves); the chain is the same depth. Every setting's tokens must equal the
chain's (greedy, lossless): the script stops if not. Figures: median over repeats of tokens/s, and accepted draft
tokens per target pass (summed over the problems).

Resumable and cheap to rerun: each finished (setting, repeat) is appended to OUT/runs.jsonl and skipped when the
script runs again with the same arguments (the table is rebuilt from the file); --fresh starts over.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import time
from pathlib import Path

import jax
import numpy as np

from parse_jax.checkpoints.pair import load_pair
from parse_jax.harness.runs import interleaved
from parse_jax.runtime.programs import bucket
from parse_jax.speculation.eagle3 import eagle3_generate
from parse_jax.tasks.arith import load_task


def settings(depth: int, trees: str) -> dict[str, tuple[int, int, int]]:
    """name -> (tree nodes beyond the depth, top-k, paths per depth: 0 all k); the chain is (0, 1, 0)."""
    out = {f"chain d{depth}": (0, 1, 0)}
    for item in filter(None, trees.split(",")):
        nodes, k, width = ([int(x) for x in item.split(":")] + [0])[:3]
        out[f"tree d{depth} +{nodes} k{k}" + (f" w{width}" if width else "")] = (nodes, k, width)
    return out


def run_one(target, head, prompts, depth: int, setting: tuple[int, int, int], max_new: int) -> dict:
    toks, passes, accepted, new, seconds = [], 0, 0, 0, 0.0
    nodes, k, width = setting
    for p in prompts:
        t0 = time.perf_counter()
        r = eagle3_generate(target, head, [p], gamma=depth, tree=nodes, tree_top_k=k, tree_width=width,
                            max_new_tokens=max_new)
        seconds += time.perf_counter() - t0
        s = r.stats
        toks.append(r.tokens[0])
        passes += s["num_drafts"]
        accepted += s["accepted_tokens"]
        new += s["new_tokens"]
    return {"tokens": toks, "passes": passes, "accepted": accepted, "new_tokens": new, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--trees", default="4:2,8:2,8:4",
                    help="NODES:K[:W],... (tree nodes beyond the depth : top-k [: paths drafted per depth])")
    ap.add_argument("--out", default="benchmarks/results/bench_eagle3_tree")
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.jsonl"
    key = {"n": args.n, "depth": args.depth, "max_new": args.max_new, "trees": args.trees}
    done = []
    if runs_file.exists() and not args.fresh:
        done = [r for r in map(json.loads, runs_file.read_text().splitlines()) if r["key"] == key]
    elif runs_file.exists():
        runs_file.unlink()
    have = {(r["setting"], r["repeat"]) for r in done}

    target, _ = load_pair()
    head = target.eagle3
    prompts = [q for q, _ in load_task("default").problems(args.n, 0)]
    encoded = [target.tokenizer.encode(q) for q in prompts]
    bos = target.tokenizer.bos_id
    encoded = [([bos] if bos is not None else []) + x for x in encoded]
    table = settings(args.depth, args.trees)
    shapes = list({bucket(len(p)): p for p in encoded}.values())  # one prompt per program shape
    for name, setting in table.items():  # warm-up: compile every program once
        if any((name, r) not in have for r in range(args.repeats)):
            run_one(target, head, shapes, args.depth, setting, args.max_new)
    for rep in range(args.repeats):
        for name in interleaved(list(table), 0, rep, 0):  # a seeded shuffle per repeat, as `measure` runs
            if (name, rep) in have:
                continue
            gc.collect()  # not on this run's time: the previous run's garbage
            r = run_one(target, head, encoded, args.depth, table[name], args.max_new)
            row = {"key": key, "setting": name, "repeat": rep, **{x: r[x] for x in r if x != "tokens"},
                   "tokens": r["tokens"]}
            with runs_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            done.append(row)
            print(f"repeat {rep} {name}: {r['new_tokens'] / r['seconds']:.1f} tok/s, "
                  f"{r['accepted'] / r['passes']:.2f} accepted/pass", flush=True)
    write_table(out, done, table, args)


def write_table(out: Path, done: list[dict], table: dict, args) -> None:
    chain = next(iter(table))
    ref = next(r["tokens"] for r in done if r["setting"] == chain)
    rows = []
    for name in table:
        rs = [r for r in done if r["setting"] == name]
        if any(r["tokens"] != ref for r in rs):
            raise SystemExit(f"{name}: tokens differ from the chain's (greedy EAGLE-3 must be lossless)")
        tps = [r["new_tokens"] / r["seconds"] for r in rs]
        per_rep = {r["repeat"]: r["new_tokens"] / r["seconds"] for r in rs}
        chain_rep = {r["repeat"]: r["new_tokens"] / r["seconds"] for r in done if r["setting"] == chain}
        ratio = [per_rep[i] / chain_rep[i] for i in per_rep if i in chain_rep]
        acc = rs[0]["accepted"] / rs[0]["passes"]
        rows.append({"setting": name, "tree": table[name][0], "top_k": table[name][1], "width": table[name][2],
                     "tokens_per_s": float(np.median(tps)), "vs_chain": float(np.median(ratio)),
                     "vs_chain_min": float(min(ratio)), "vs_chain_max": float(max(ratio)),
                     "accepted_per_pass": acc, "tokens_per_pass": rs[0]["new_tokens"] / rs[0]["passes"],
                     "repeats": len(rs)})
    cmd = (f"python benchmarks/bench_eagle3_tree.py --n {args.n} --repeats {args.repeats} --depth {args.depth} "
           f"--max-new {args.max_new} --trees {args.trees} --out {args.out}")
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{args.out}"],
                      capture_output=True, text=True).stdout.strip():  # changes besides this run's own files
        commit += " (uncommitted changes)"
    info = {"command": cmd, "commit": commit, "jax": jax.__version__, "device": str(jax.devices()[0]),
            "machine": platform.machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    (out / "bench.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = ["# EAGLE-3 chain vs trees (embedded pair, batch 1)", "", f"Command: `{cmd}`", "",
             f"{args.n} held-out problems of the embedded task, one request at a time, greedy, at most "
             f"{args.max_new} new tokens; settings interleaved in one process, {args.repeats} repeats; tokens/s: "
             "median over repeats (speed-up: median, min-max of the per-repeat ratio to the chain); every setting's "
             "tokens equal the chain's. A tree `+N kK`: depth d, d + N nodes, the K most likely expanded per depth; "
             "`wW`: W paths drafted per depth (w1: the chain's nodes, their likeliest siblings as leaves) "
             "(docs/design.md, EAGLE-3).", "",
             "| setting | tok/s | vs chain (min-max) | accepted / pass | tokens / pass |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['tokens_per_s']:.1f} | {r['vs_chain']:.2f}x ({r['vs_chain_min']:.2f}-"
                     f"{r['vs_chain_max']:.2f}) | {r['accepted_per_pass']:.2f} | {r['tokens_per_pass']:.2f} |")
    lines += ["", f"Commit {commit}; jax {jax.__version__} on {jax.devices()[0]}; {info['date']}."]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
