"""Accuracy with a 95% Wilson interval, and the summary of an eval's results file.

Wilson, not the normal approximation: it stays inside [0, 1] and is honest at 0 or n successes and small n,
which is where quick evals live.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

from parse_jax.runtime.metrics import derived

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when there is no trial."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, {n}], got {successes}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0 or n successes a bound is exactly 0 or 1 (centre and half agree there; computed, they differ by rounding)
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def summarize(results: Iterable[dict]) -> dict:
    """Totals over result records (one per record key; a repeated key counts once, the last one)."""
    by_key = {r["key"]: r for r in results}
    rows = list(by_key.values())
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    lo, hi = wilson(correct, n)
    tokens = sum(int(r.get("new_tokens", 0)) for r in rows)
    seconds = sum(float(r.get("seconds", 0.0)) for r in rows)
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r.get("kind", "?")] = kinds.get(r.get("kind", "?"), 0) + 1
    spec = [r for r in rows if "accepted_tokens" in r and r.get("verify_passes")]
    passes = sum(int(r["verify_passes"]) for r in spec)
    out = {"n": n, "correct": correct, "accuracy": correct / n if n else None, "accuracy_ci95": [lo, hi],
           "no_answer": sum(r.get("extracted") is None for r in rows), "new_tokens": tokens,
           "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
           "accepted_per_pass": sum(int(r["accepted_tokens"]) for r in spec) / passes if passes else None,
           "kinds": kinds}
    for scoring in ("strict", "flexible"):  # lm-eval's gsm8k strict-match and flexible-extract, beside ours
        scored = [r for r in rows if f"correct_{scoring}" in r]
        if scored:
            hits = sum(bool(r[f"correct_{scoring}"]) for r in scored)
            out[f"accuracy_{scoring}"] = hits / len(scored)
            out[f"accuracy_{scoring}_ci95"] = list(wilson(hits, len(scored)))
    ran = collections.Counter(r["ran"] for r in rows if "ran" in r)  # what schedule="auto" ran, in records
    if ran:
        out["schedule_ran"] = dict(sorted(ran.items()))
    out.update(speculation_totals([r["stats"] for r in rows if "stats" in r]))
    return out


def speculation_totals(stats: list[dict]) -> dict:
    """The records' speculation counts summed, under the names of docs/metrics.md, with the rates
    `runtime.metrics.derived` takes from the sums: sd / eagle3 `num_drafts`, `num_accepted_tokens`,
    `acceptance_length` (vLLM's); PARSE `num_steps_drafted`, `num_verifications`, `accepted_tokens_per_verification`."""
    counts: dict = {}
    drafted = [s for s in stats if "num_drafts" in s]
    if drafted:
        counts.update(num_drafts=sum(s["num_drafts"] for s in drafted),
                      num_accepted_tokens=sum(s["accepted_tokens"] for s in drafted))
    stepped = [s for s in stats if "steps_drafted" in s]
    if stepped:
        counts.update(num_steps_drafted=sum(s["steps_drafted"] for s in stepped),
                      num_verifications=sum(s.get("verify_passes", 0) for s in stepped))
    accepted = {"accepted_tokens": sum(s["accepted_tokens"] for s in stepped)} if stepped else {}
    rates = {k: v for k, v in derived({**counts, **accepted}).items() if v is not None}
    return {**counts, **rates}


def format_summary(s: dict) -> str:
    if not s["n"]:
        return "no records evaluated"
    lo, hi = s["accuracy_ci95"]
    tps = f", {s['tokens_per_s']:.1f} tok/s" if s.get("tokens_per_s") else ""
    lm = "".join(f", {name} {100 * s[f'accuracy_{key}']:.1f}%" for key, name in
                 (("strict", "strict-match"), ("flexible", "flexible-extract")) if f"accuracy_{key}" in s)
    ran = ""
    if s.get("schedule_ran"):
        told = sum(s["schedule_ran"].values())  # records of an older results file say nothing
        of = f" (of {s['n']})" if told < s["n"] else ""
        ran = ("; schedule auto ran " + ", ".join(f"{name} for {count}" for name, count in s["schedule_ran"].items())
               + f" records{of} (target: plain decoding)")
    return (f"accuracy {100 * s['accuracy']:.1f}% ({s['correct']}/{s['n']}; 95% CI {100 * lo:.1f}-{100 * hi:.1f}%)"
            f"{lm}, {s['no_answer']} without an answer, {s['new_tokens']} new tokens{tps}{ran}")
