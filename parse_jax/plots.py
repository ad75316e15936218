"""PNG plots of bench and sweep results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402


def _errors(values: list[float], low: list[float], high: list[float]) -> np.ndarray:
    v = np.asarray(values)
    return np.stack([v - np.asarray(low), np.asarray(high) - v]).clip(min=0)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_plots(result: dict, folder: Path) -> list[Path]:
    """bench_throughput.png (tokens/s and speed-up per mode, min-max over repeats) and bench_accuracy.png."""
    modes = list(result["modes"])
    rows = [result["modes"][m] for m in modes]
    x = np.arange(len(modes))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(modes) + 4), 4))
    tps = [r["tokens_per_s"] for r in rows]
    a.bar(x, tps, yerr=_errors(tps, [min(r["tokens_per_s_all"]) for r in rows],
                                 [max(r["tokens_per_s_all"]) for r in rows]), capsize=4, color="tab:blue")
    a.set_ylabel("tokens / s (median, min-max over repeats)")
    sp = [r["speedup_vs_target"] for r in rows]
    b.bar(x, sp, yerr=_errors(sp, [r["speedup_min"] for r in rows], [r["speedup_max"] for r in rows]), capsize=4,
          color="tab:orange")
    b.axhline(1.0, color="gray", lw=1, ls="--")
    b.set_ylabel("speed-up vs target (median, min-max)")
    for ax in (a, b):
        ax.set_xticks(x, modes, rotation=30, ha="right")
    fig.suptitle(f"parse-jax bench: {result['n']} problems, batch {result['batch_size']}, {result['repeats']} repeats")
    paths = [_save(fig, folder / "bench_throughput.png")]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(modes) + 2), 4))
    acc = [100 * r["accuracy"] for r in rows]
    ci = [r.get("accuracy_ci95") or [r["accuracy"]] * 2 for r in rows]
    ax.bar(x, acc, yerr=_errors(acc, [100 * c[0] for c in ci], [100 * c[1] for c in ci]), capsize=4, color="tab:green")
    ax.set_ylim(0, 105)
    ax.set_ylabel("final-answer accuracy, % (95% Wilson CI)")
    ax.set_xticks(x, modes, rotation=30, ha="right")
    ax.set_title(f"accuracy on {result['n']} held-out problems")
    paths.append(_save(fig, folder / "bench_accuracy.png"))
    return paths


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher throughput and higher accuracy),
    sorted by throughput."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def sweep_plots(result: dict, folder: Path, stem: str) -> list[Path]:
    """STEM.png (speed-up and accuracy per value) and STEM_pareto.png (accuracy vs tokens/s, Pareto front)."""
    pts = result["points"]
    labels = [str(p["value"]) for p in pts]
    base = result["baseline"]
    x = np.arange(len(pts))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(pts) + 6), 4))
    sp = [p["speedup_vs_target"] for p in pts]
    a.errorbar(x, sp, yerr=_errors(sp, [p["speedup_min"] for p in pts], [p["speedup_max"] for p in pts]),
               marker="o", capsize=4)
    a.axhline(1.0, color="gray", lw=1, ls="--", label="target")
    a.set_ylabel("speed-up vs target (median, min-max)")
    acc = [100 * p["accuracy"] for p in pts]
    b.errorbar(x, acc, yerr=_errors(acc, [100 * p["accuracy_ci95"][0] for p in pts],
                                    [100 * p["accuracy_ci95"][1] for p in pts]), marker="o", capsize=4)
    b.axhline(100 * base["accuracy"], color="gray", lw=1, ls="--", label="target")
    b.set_ylabel("accuracy, % (95% CI)")
    for ax in (a, b):
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_xlabel(result["param"])
        ax.legend()
    fig.suptitle(f"{result['mode']}: sweep of {result['param']} ({result['n']} problems)")
    paths = [_save(fig, folder / f"{stem}.png")]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xy = [(p["tokens_per_s"], 100 * p["accuracy"]) for p in pts]
    ax.scatter([q[0] for q in xy], [q[1] for q in xy], color="tab:blue", label=result["mode"])
    for (px, py), label in zip(xy, labels):
        ax.annotate(label, (px, py), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(xy)
    ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], color="tab:blue", lw=1, ls="--",
            label="Pareto front")
    ax.scatter([base["tokens_per_s"]], [100 * base["accuracy"]], marker="*", s=150, color="tab:red", label="target")
    ax.set_xlabel("tokens / s (median over repeats)")
    ax.set_ylabel("final-answer accuracy, %")
    ax.set_title(f"accuracy vs throughput over {result['param']}")
    ax.legend()
    paths.append(_save(fig, folder / f"{stem}_pareto.png"))
    return paths
