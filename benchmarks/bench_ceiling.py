"""Where a batch-1 request's time goes, on the embedded pair: draft, verification, continuation (the target's own
tokens, plain or EAGLE-3), commit and the rest of the program, host; the draft-only ceiling; the accepted fraction.
For parse (single round), parse-multi, parse+eagle3 and parse+eagle3-multi.

How each part is found (the method the brief lets us name):
- wall: `ParseEngine.generate` for one prompt;
- device: the same request's program run again on its inputs already on the device (`block_until_ready`), as
  `bench_host_share.py` does; host = wall - device (encoding, validation, padding, the fetch, decoding, stats);
- draft, verification, continuation: the request's own counters (draft tokens written, verification passes and
  their tokens, the target's other passes, EAGLE-3 proposals) times the per-pass costs of
  `parse_jax/schedule/costs.py` (`pass_costs`: the cached profile of each model when there is one, else its
  roofline; the md says which), at batch 1 and the request's cache bucket, each less what a pass of that model
  costs alone beyond a step inside a program: a profile times each pass as its own program (dispatched from the
  host), and inside a request's program no pass is. Measured here per model (`loop_step`): its one-token pass as
  profiled, less its step inside its own decode loop (one program timed at two budgets with no EOS, the difference
  over the extra steps, so that the prefill is left out). The EAGLE-3 head, a one-layer model, is charged the
  draft's figure;
- commit and the rest: device - (draft + verification + continuation): acceptance, commits, segmentation, sampling,
  loop control, and the cost model's own error (it can come out negative where the model overstates a pass).
- ceiling: the draft alone writing the same budget on the same prompts; each mode's tokens/s as a share of it.

    python benchmarks/bench_ceiling.py [--n 20] [--repeats 2] [--out benchmarks/results/ceiling_b1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import parse_jax as pj
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.harness.provenance import provenance
from parse_jax.modes.parse import multi_launch, single_launch
from parse_jax.runtime.decode import generate_cache_len, generate_launch
from parse_jax.runtime.programs import length_bucket
from parse_jax.schedule.profile import pass_costs
from parse_jax.utils import atomic

MAX_NEW = 32  # bench's default budget
MODES = {  # label: (engine mode, rounds)
    "parse": ("parse", "single"), "parse-multi": ("parse", "multi"),
    "parse+eagle3": ("parse+eagle3", "single"), "parse+eagle3-multi": ("parse+eagle3", "multi")}
PARTS = ("draft", "verification", "continuation", "commit_and_rest", "host")


def launch_of(eng: ParseEngine, label: str, prompt: str):
    """(program, device-placed args) that `eng.generate([prompt], mode)` runs at batch 1 (the fused program)."""
    mode, rounds = MODES[label]
    req = eng.request([prompt], mode, MAX_NEW, 0.0, 0, 0, 1.0, None)
    eagle = mode == "parse+eagle3"
    launch = multi_launch(eng.context, req, eagle) if rounds == "multi" else single_launch(eng.context, req, eagle)
    return launch.program, jax.device_put(launch.args)


def loop_step(costs, role: str, model, prompts: list[list[int]], sampling, budgets=(33, 64),
              repeats: int = 5) -> tuple[float, float]:
    """(seconds of one step of `model`'s own decode loop at batch 1, what its one-token pass costs dispatched alone
    beyond that step), averaged over `prompts`. The loop is timed at two budgets of one program (same output bucket,
    same cache: only `max_new` differs) with no EOS, so every step runs; the difference of the medians over the extra
    steps leaves out the prefill and the program's fixed cost. The profiled pass is read at that program's cache
    (a drafter's profile has one cache length, 256)."""
    never = np.array([-1], np.int32)  # the library's "no stop ids": every row runs its whole budget
    steps, alone = [], []
    capacity = model.config.max_position_embeddings
    for ids in prompts:
        times = []
        for n in budgets:
            program, a = generate_launch(model, [ids], n, sampling, never, capacity)
            a = jax.device_put(a)
            jax.block_until_ready(program(*a))  # compiled and warm
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(program(*a))
                runs.append(time.perf_counter() - t0)
            times.append(statistics.median(runs))
        step = (times[1] - times[0]) / (budgets[1] - budgets[0])
        steps.append(step)
        alone.append(max(costs.seconds(role, 1, 1, generate_cache_len([ids], budgets[1], capacity)) - step, 0.0))
    return statistics.mean(steps), statistics.mean(alone)


def modelled(costs, eng: ParseEngine, stats: dict, prompt_len: int, multi: bool, alone: dict) -> dict:
    """Seconds of draft, verification and continuation of one request: its counters times the per-pass costs, each
    less `alone[model]` (what a pass costs alone beyond a step inside a program: these passes run inside one)."""
    cache = length_bucket(prompt_len + MAX_NEW + 64)
    cfg = eng.config

    def pass_s(model: str, tokens: int) -> float:
        return max(costs.seconds(model, 1, tokens, cache) - alone[model], 0.0)

    verify_passes = stats["verify_passes"]
    block = max(1, round(stats["verify_tokens"] / max(verify_passes, 1)))
    draft = stats["draft_tokens"] * pass_s("draft", 1)
    if multi:  # each later round the draft reads the target's last step in one pass
        draft += max(verify_passes - 1, 0) * pass_s("draft", cfg.max_segment + 2)
    verification = verify_passes * pass_s("target", block)
    cont_passes = stats["target_passes"] - verify_passes
    if stats.get("eagle3_draft_tokens") is not None:  # chains of gamma (+ tree leaves) verified per target pass
        g, tree = cfg.eagle3.gamma, cfg.eagle3.tree
        continuation = (cont_passes * (pass_s("target", g + 1 + tree) + g * pass_s("eagle3", 1)
                                       + pass_s("eagle3", g + 1 + tree))
                        + verify_passes * pass_s("eagle3", block))  # the head reads each block
    else:
        continuation = cont_passes * pass_s("target", 1)
    return {"draft": draft, "verification": verification, "continuation": continuation}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/ceiling_b1")
    args = ap.parse_args(argv)
    target, draft = pj.load_pair()
    problems = [p for p, _ in pj.load_task().problems(args.n, seed=12345)]
    engines = {label: ParseEngine(target, draft, ParseConfig(rounds=rounds, schedule="fixed"))
               for label, (_, rounds) in MODES.items()}
    costs = pass_costs(target, draft, head=target.eagle3)
    ids = [engines["parse"].request([p], "parse", MAX_NEW, 0.0, 0, 0, 1.0, None).ids[0] for p in problems]
    alone_req = engines["parse"].request(problems[:1], "target", MAX_NEW, 0.0, 0, 0, 1.0, None)
    sums = {m: {k: 0.0 for k in ("wall", "device", "tokens", "accepted", "draft", "verification", "continuation")}
            for m in MODES}
    draft_time = draft_tokens = 0.0
    requests = []  # (label, stats, prompt length, multi) of every counted request
    for label in MODES:  # compile every bucket the problems use
        for p in problems[:4]:
            engines[label].generate([p], mode=MODES[label][0], max_new_tokens=MAX_NEW)
            program, a = launch_of(engines[label], label, p)
            jax.block_until_ready(program(*a))
    for rep in range(args.repeats):
        for i, p in enumerate(problems):
            program, a = generate_launch(draft, [ids[i]], MAX_NEW, alone_req.sampling, alone_req.eos,
                                         draft.config.max_position_embeddings)
            a = jax.device_put(a)
            jax.block_until_ready(program(*a))  # compiled (and warm) before it is timed
            t0 = time.perf_counter()
            out = jax.block_until_ready(program(*a))
            if rep or args.repeats == 1:  # the first of several repeats warms
                draft_time += time.perf_counter() - t0
                draft_tokens += int(np.asarray(out[1]).sum())
            for label, (mode, rounds) in MODES.items():
                eng = engines[label]
                t0 = time.perf_counter()
                res = eng.generate([p], mode=mode, max_new_tokens=MAX_NEW)
                wall = time.perf_counter() - t0
                program, a = launch_of(eng, label, p)
                t0 = time.perf_counter()
                jax.block_until_ready(program(*a))
                device = time.perf_counter() - t0
                if not rep and args.repeats > 1:
                    continue
                s = sums[label]
                s["wall"] += wall
                s["device"] += device
                s["tokens"] += res.stats["new_tokens"]
                s["accepted"] += res.stats["accepted_tokens"]
                requests.append((label, res.stats, len(ids[i]), rounds == "multi"))
    ceiling = draft_tokens / draft_time
    # role: (step inside its own loop, its one-token pass alone less that), each the mean over 4 prompts; taken
    # as one fixed cost per pass whatever its cache (it is the dispatch; the cache moves the step, on both sides)
    steps = {role: loop_step(costs, role, model, ids[:4], alone_req.sampling)
             for role, model in (("draft", draft), ("target", target))}
    alone = {role: a for role, (_, a) in steps.items()}
    alone["eagle3"] = alone["draft"]
    for label, stats, prompt_len, multi in requests:
        for k, v in modelled(costs, engines[label], stats, prompt_len, multi, alone).items():
            sums[label][k] += v
    rows = {}
    for label, s in sums.items():
        parts = {k: s[k] for k in ("draft", "verification", "continuation")}
        parts["commit_and_rest"] = s["device"] - sum(parts.values())
        parts["host"] = s["wall"] - s["device"]
        tok_s = s["tokens"] / s["wall"]
        rows[label] = {"tokens_per_s": tok_s, "share_of_draft_ceiling": tok_s / ceiling,
                       "accepted_fraction": s["accepted"] / s["tokens"],
                       "ms_per_request": {k: 1e3 * v / (len(problems) * max(args.repeats - 1, 1))
                                          for k, v in {"wall": s["wall"], "device": s["device"], **parts}.items()},
                       "share_of_wall": {k: parts[k] / s["wall"] for k in PARTS}}
    command = "python benchmarks/bench_ceiling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command.strip(), "max_new_tokens": MAX_NEW, "draft_ceiling_tokens_per_s": ceiling,
              "cost_sources": costs.sources, "modes": rows,
              "in_loop_step_ms": {role: 1e3 * step for role, (step, _) in steps.items()},
              "alone_ms": {role: 1e3 * v for role, v in alone.items()},
              "provenance": provenance({"n": args.n, "repeats": args.repeats})}
    text = report(result)
    print(text)
    out = Path(args.out)
    atomic.write_json(out / "ceiling.json", result)
    atomic.write_text(out / "ceiling.md", text)
    return 0


def report(result: dict) -> str:
    prov = result["provenance"]
    step, alone = result["in_loop_step_ms"], result["alone_ms"]
    lines = ["# Where a batch-1 request's time goes, embedded pair", "", f"Command: `{result['command']}`", "",
             f"{prov['config']['n']} held-out problems, batch 1, greedy, at most {result['max_new_tokens']} new "
             f"tokens, {prov['config']['repeats']} repeats (the first warms and is not counted), modes interleaved "
             "per problem. Wall: `generate`; device: the request's program alone on its inputs; host = wall - "
             "device. Draft / verification / continuation: the request's counters times the per-pass costs of "
             f"parse_jax/schedule/costs.py (sources: {result['cost_sources']}), each pass less what a pass of "
             "that model costs alone beyond a step inside a program: its one-token pass as profiled less its step "
             f"inside its own decode loop (draft {alone['draft']:.3f} ms, its step {step['draft']:.3f} ms; target "
             f"{alone['target']:.3f} ms, its step {step['target']:.2f} ms; the EAGLE-3 head is charged the "
             "draft's); commit and rest = device - those "
             "three (acceptance, commits, segmentation, sampling, loop control, and the cost model's error).",
             "", f"Draft-only ceiling: {result['draft_ceiling_tokens_per_s']:.0f} tokens/s (the draft alone, same "
             "prompts and budget, program alone).", "",
             "| mode | tok/s | share of draft ceiling | accepted fraction | wall ms | draft | verification | "
             "continuation | commit + rest | host |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in result["modes"].items():
        ms, sh = r["ms_per_request"], r["share_of_wall"]
        cells = " | ".join(f"{ms[k]:.1f} ms ({100 * sh[k]:.0f}%)" for k in PARTS)
        lines.append(f"| {m} | {r['tokens_per_s']:.0f} | {100 * r['share_of_draft_ceiling']:.1f}% | "
                     f"{100 * r['accepted_fraction']:.0f}% | {ms['wall']:.1f} | {cells} |")
    lines += ["", f"Commit {prov.get('git_commit')} (dirty: {prov.get('git_dirty')}); jax {prov.get('jax')} on "
              f"{prov.get('device')} ({prov.get('cpu_count')} CPUs); {prov.get('time_utc')}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
