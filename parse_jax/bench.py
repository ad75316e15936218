"""`parse-jax bench`: every mode on the same held-out problems, in one process, interleaved and repeated.

Timing is wall-clock around `ParseEngine.generate` (host work included), after one untimed warm-up call
per mode and batch shape, so compilation is not counted. Speed-ups are ratios against `target` within the
same repeat; the table shows their median and range over repeats. Passes are counted per request (a batched
pass counts once for each row it serves): "accepted / pass" is accepted draft tokens per request per
verification (per target round in `sd`), "target passes / 100 tok" is target passes per request per 100 tokens.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from parse_jax.decode import compiled_programs, generate
from parse_jax.engine import MODES, ParseEngine
from parse_jax.errors import InputError

BENCH_MODES = (*MODES, "draft")  # "draft": the draft alone, the ceiling if every draft were accepted for free


def provenance() -> dict:
    """What made a result: commit, versions, device."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"git_commit": commit or "unknown", "jax": jax.__version__, "device": str(jax.devices()[0]),
            "platform": platform.platform(), "python": platform.python_version()}


def _run_mode(eng: ParseEngine, mode: str, prompts: list[str], max_new_tokens: int, seed: int):
    if mode == "draft":
        return generate(eng.draft, prompts, max_new_tokens=max_new_tokens, seed=seed)
    return eng.generate(prompts, mode=mode, max_new_tokens=max_new_tokens, seed=seed)


def check_modes(modes: Sequence[str]) -> list[str]:
    """The requested modes, deduplicated, in order; an unknown one (or none) is an InputError."""
    modes = list(dict.fromkeys(modes))
    unknown = [m for m in modes if m not in BENCH_MODES]
    if unknown or not modes:
        raise InputError(f"unknown mode(s) {unknown or modes}; available: {', '.join(BENCH_MODES)}")
    return modes


def run_bench(eng: ParseEngine, task, n: int = 100, modes: Sequence[str] = ("target", "sequential", "parse"),
              max_new_tokens: int = 64, batch_size: int = 16, repeats: int = 3, seed: int = 0,
              progress: bool = True, log: Callable[[str], None] = print) -> dict:
    modes = check_modes(modes)
    if "target" not in modes:
        modes = ["target", *modes]  # the baseline every speed-up is measured against
    if n < 1 or batch_size < 1 or repeats < 1:
        raise InputError("n, batch_size and repeats must be >= 1")
    problems = task.problems(n, seed)
    prompts = [p for p, _ in problems]
    chunks = [prompts[i:i + batch_size] for i in range(0, n, batch_size)]
    for mode in modes:  # warm-up: compile every program the timed runs use
        for shape in {len(c) for c in chunks}:
            _run_mode(eng, mode, next(c for c in chunks if len(c) == shape), max_new_tokens, seed)
    seconds = {m: np.zeros(repeats) for m in modes}
    outputs: dict[str, list] = {m: [None] * n for m in modes}
    stats_sum: dict[str, dict] = {m: {} for m in modes}
    bar = tqdm(total=repeats * len(chunks) * len(modes), desc="bench", disable=not progress)
    for r in range(repeats):
        for ci, chunk in enumerate(chunks):
            order = modes[ci % len(modes):] + modes[:ci % len(modes)]  # interleave: rotate who goes first
            for mode in order:
                t0 = time.perf_counter()
                res = _run_mode(eng, mode, chunk, max_new_tokens, seed)
                seconds[mode][r] += time.perf_counter() - t0
                if r == 0:
                    outputs[mode][ci * batch_size: ci * batch_size + len(chunk)] = list(zip(res.texts, res.tokens))
                    for key, value in res.stats.items():
                        if isinstance(value, (int, float)) and not isinstance(value, bool):
                            stats_sum[mode][key] = stats_sum[mode].get(key, 0) + value
                    # passes are batched: per request, each pass of this chunk counts once per row
                    acc = stats_sum[mode]
                    acc["row_passes"] = acc.get("row_passes", 0) + res.stats.get("target_passes", 0) * len(chunk)
                    checks = res.stats.get("verify_passes", res.stats.get("target_passes", 0))
                    acc["row_checks"] = acc.get("row_checks", 0) + checks * len(chunk)
                bar.update(1)
                bar.set_postfix(mode=mode, repeat=r)
    bar.close()
    result = {"modes": {}, "n": n, "max_new_tokens": max_new_tokens, "batch_size": batch_size, "repeats": repeats,
              "seed": seed, "parse_config": eng.config.__dict__, "provenance": provenance(),
              "compiled_programs": compiled_programs()}
    for mode in modes:
        texts_tokens = outputs[mode]
        new_tokens = sum(len(t) for _, t in texts_tokens)
        correct = [bool(task.grade(p, text)) for p, (text, _) in zip(prompts, texts_tokens)]
        tps = new_tokens / seconds[mode]
        speedups = seconds["target"] / seconds[mode] * (new_tokens / max(sum(len(t) for _, t in outputs["target"]),
                                                                         1))
        s = stats_sum[mode]
        passes = s.get("target_passes", 0)
        row = {
            "tokens_per_s": float(np.median(tps)),
            "tokens_per_s_all": tps.tolist(),
            "seconds_median": float(np.median(seconds[mode])),
            "seconds_all": seconds[mode].tolist(),
            "speedup_vs_target": float(np.median(speedups)),
            "speedup_min": float(np.min(speedups)), "speedup_max": float(np.max(speedups)),
            "accuracy": float(np.mean(correct)),
            "new_tokens": int(new_tokens),
            "target_passes": int(passes),
            "target_passes_per_100_tokens": 100.0 * s.get("row_passes", 0) / max(new_tokens, 1),
            "accepted_per_pass": (s["accepted_tokens"] / max(s.get("row_checks", 0), 1)
                                  if "accepted_tokens" in s else None),
            "draft_tokens": int(s.get("draft_tokens", 0)),
            "accepted_tokens": int(s.get("accepted_tokens", 0)),
            "verify_tokens": int(s.get("verify_tokens", 0)),
            "verify_passes": int(s.get("verify_passes", 0)),
        }
        result["modes"][mode] = row
    if "draft" in result["modes"] and "parse" in result["modes"]:
        result["parse_fraction_of_draft_only"] = (result["modes"]["parse"]["tokens_per_s"]
                                                  / result["modes"]["draft"]["tokens_per_s"])
    log(format_table(result))
    return result


def format_table(result: dict) -> str:
    lines = ["| mode | tok/s | speed-up vs target (min-max) | accuracy | accepted / pass | target passes / 100 tok |",
             "|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        acc_pass = "-" if r["accepted_per_pass"] is None else f"{r['accepted_per_pass']:.1f}"
        lines.append(f"| {mode} | {r['tokens_per_s']:.1f} | {r['speedup_vs_target']:.2f}x "
                     f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {100 * r['accuracy']:.1f}% | {acc_pass} | "
                     f"{r['target_passes_per_100_tokens']:.1f} |")
    return "\n".join(lines)


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
        tmp.replace(path)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e}") from None
    return path
