"""PNG plots of bench, sweep and block-cost results (matplotlib, Agg backend: no display needed).

Made to be read at a glance: every bar carries its value; the target is a dashed reference line labelled "target";
the draft alone (the ceiling if every draft were accepted for free) gets its own panel, so its bar does not flatten
the others; point labels are placed where they overlap nothing (`label_points`), and the Pareto front is drawn as
the staircase it is. The `*_figures` functions return the figures (tests measure their text boxes); the `*_plots`
functions write them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import matplotlib.lines

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

DPI = 110
TARGET_COLOR = "0.45"


def _errors(values: Sequence[float], low: Sequence[float], high: Sequence[float]) -> np.ndarray:
    v = np.asarray(values, float)
    return np.stack([v - np.asarray(low, float), np.asarray(high, float) - v]).clip(min=0)


def _save(fig: Figure, path: Path) -> Path:
    """Write whole or not at all (a temporary file renamed into place): an old plot survives a failed run."""
    from parse_jax.utils.atomic import replacing

    path = Path(path)
    try:
        with replacing(path) as tmp:
            fig.savefig(tmp, dpi=DPI, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path


def _freeze_layout(fig: Figure) -> None:
    """Run the layout engine once and keep its result: later draws then place every artist where it was measured
    (labels positioned from pixel boxes stay apart)."""
    fig.canvas.draw()
    fig.set_layout_engine("none")


def _reference(ax, y: float, label: str) -> None:
    """A dashed horizontal line at `y`, labelled just outside the right edge of the axes (where no data label is)."""
    ax.axhline(y, color=TARGET_COLOR, lw=1.2, ls="--", zorder=1)
    ax.annotate(label, xy=(1.0, y), xycoords=("axes fraction", "data"), xytext=(4, 0), textcoords="offset points",
                ha="left", va="center", fontsize=8, color=TARGET_COLOR)


def _tick_labels(ax, labels: Sequence[str]) -> None:
    """Category labels, turned 30 degrees only when they would not fit side by side."""
    x = np.arange(len(labels))
    width_in = ax.figure.get_figwidth() * ax.get_position().width
    slot_chars = 72 * width_in / max(len(labels), 1) / 6.0  # ~6 points per character at size 9
    rotate = max((len(s) for s in labels), default=0) + 1 > slot_chars
    ax.set_xticks(x, labels, rotation=30 if rotate else 0, ha="right" if rotate else "center",
                  rotation_mode="anchor" if rotate else "default", fontsize=9)


def _bars(ax, labels: Sequence[str], values: Sequence[float], low: Sequence[float], high: Sequence[float],
          fmt: str, color: str, colors: Sequence[str] | None = None) -> None:
    """Bars with min-max error bars, each labelled with its value above the error bar; room is left for labels."""
    x = np.arange(len(labels))
    ax.bar(x, values, yerr=_errors(values, low, high), capsize=4, color=colors or color, zorder=2)
    tops = np.maximum(np.asarray(values, float), np.asarray(high, float))
    for xi, top, v in zip(x, tops, values):
        ax.annotate(fmt.format(v), (xi, top), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylim(0, max(float(tops.max(initial=0.0)), 1e-9) * 1.2)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    _tick_labels(ax, labels)


def bench_figures(result: dict) -> dict[str, Figure]:
    """{"bench_throughput": tokens/s and speed-up per mode (+ the draft-alone ceiling in its own panel),
    "bench_accuracy": final-answer accuracy per mode}."""
    rows = result["modes"]
    main = [m for m in rows if m != "draft"]
    ceiling = rows.get("draft")
    widths = [len(main), len(main)] + ([1.3] if ceiling else [])
    fig, axes = plt.subplots(1, len(widths), figsize=(max(9.0, 2.6 * len(main) + 3), 4.6), width_ratios=widths,
                             layout="constrained")
    a, b = axes[0], axes[1]
    colors = [TARGET_COLOR if m == "target" else None for m in main]
    tps = [rows[m]["tokens_per_s"] for m in main]
    _bars(a, main, tps, [min(rows[m]["tokens_per_s_all"]) for m in main],
          [max(rows[m]["tokens_per_s_all"]) for m in main], "{:.0f}", "tab:blue",
          [c or "tab:blue" for c in colors])
    a.set_ylabel("tokens / s (median; bars: min-max over repeats)")
    a.set_title("throughput", fontsize=10)
    sp = [rows[m]["speedup_vs_target"] for m in main]
    _bars(b, main, sp, [rows[m]["speedup_min"] for m in main], [rows[m]["speedup_max"] for m in main], "{:.2f}x",
          "tab:orange", [c or "tab:orange" for c in colors])
    b.set_ylim(0, max(b.get_ylim()[1], 1.2))
    _reference(b, 1.0, "target\n1.0x")
    b.set_ylabel("speed-up vs target (median; min-max)")
    b.set_title("speed-up vs target", fontsize=10)
    if ceiling:
        c = axes[2]
        _bars(c, ["draft"], [ceiling["speedup_vs_target"]], [ceiling["speedup_min"]], [ceiling["speedup_max"]],
              "{:.2f}x", "tab:purple")
        _reference(c, 1.0, "target")
        c.set_title("draft alone\n(the ceiling)", fontsize=10)
        c.set_xlabel(f"{ceiling['tokens_per_s']:.0f} tok/s\n{100 * ceiling['accuracy']:.0f}% right", fontsize=8)
    fig.suptitle(f"parse-jax bench: {result['n']} problems, batch {result['batch_size']}, "
                 f"{result['repeats']} repeats")
    _freeze_layout(fig)
    figs = {"bench_throughput": fig}

    names = list(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2.5), 4.3), layout="constrained")
    acc = [100 * rows[m]["accuracy"] for m in names]
    ci = [rows[m].get("accuracy_ci95") or [rows[m]["accuracy"]] * 2 for m in names]
    _bars(ax, names, acc, [100 * c[0] for c in ci], [100 * c[1] for c in ci], "{:.1f}%", "tab:green",
          [TARGET_COLOR if m == "target" else "tab:green" for m in names])
    ax.set_ylim(0, 115)
    ax.set_yticks(range(0, 101, 20))
    if "target" in rows:
        _reference(ax, 100 * rows["target"]["accuracy"], "target")
    ax.set_ylabel("final-answer accuracy, % (95% Wilson CI)")
    ax.set_title(f"accuracy on {result['n']} held-out problems", fontsize=10)
    _freeze_layout(fig)
    figs["bench_accuracy"] = fig
    figs.update(acceptance_figures(rows))
    return figs


def acceptance_figures(rows: dict) -> dict[str, Figure]:
    """The field's speculation metrics (parse_jax/runtime/metrics.py), for the modes that report them:
    {"bench_acceptance": acceptance rate per draft position of each token-speculation mode (sd, eagle3),
    "bench_rejected_step": the histogram of the first rejected step of each PARSE pass}."""
    figs = {}
    spec = {m: r["acceptance_rate_per_pos"] for m, r in rows.items() if r.get("acceptance_rate_per_pos")}
    if spec:
        fig, ax = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
        xy, labels = [], []
        for m, rates in spec.items():
            pos = np.arange(1, len(rates) + 1)
            ax.plot(pos, rates, marker="o", label=f"{m} (acceptance length {rows[m]['acceptance_length']:.2f})")
            xy += [(float(x), float(y)) for x, y in zip(pos, rates)]
            labels += [f"{y:.2f}" for y in rates]
        ax.set_ylim(0, 1.25)
        ax.set_xlim(0.5, max(len(r) for r in spec.values()) + 0.5)
        ax.set_xticks(np.arange(1, max(len(r) for r in spec.values()) + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate (accepted at the position / drafts)")
        ax.set_title("acceptance per draft position", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
        label_points(ax, xy, labels)  # every point its value, where it overlaps nothing (or in the legend)
        figs["bench_acceptance"] = fig
    parse = {m: r["first_rejected_step_hist"] for m, r in rows.items() if r.get("first_rejected_step_hist")}
    if parse:
        fig, axes = plt.subplots(1, len(parse), figsize=(max(6.0, 4.5 * len(parse)), 4.3), layout="constrained",
                                 squeeze=False)
        for ax, (m, hist) in zip(axes[0], parse.items()):
            labels = [str(k + 1) for k in range(len(hist) - 1)] + ["none"]
            total = max(sum(hist), 1)
            _bars(ax, labels, [100 * h / total for h in hist], [100 * h / total for h in hist],
                  [100 * h / total for h in hist], "{:.0f}%", "tab:red",
                  ["tab:red"] * (len(hist) - 1) + ["tab:green"])
            ax.set_xlabel("first rejected step (none: every step accepted)")
            ax.set_ylabel(f"verification passes, % (of {sum(hist)})")
            ax.set_title(f"{m}: where the draft is first rejected", fontsize=10)
        _freeze_layout(fig)
        figs["bench_rejected_step"] = fig
    return figs


BENCH_PLOTS = ("bench_throughput", "bench_accuracy", "bench_acceptance", "bench_rejected_step")


def bench_plots(result: dict, folder: Path) -> list[Path]:
    """bench_throughput.png (tokens/s, speed-up, the draft-alone ceiling), bench_accuracy.png and, for the modes
    that report them, bench_acceptance.png (per draft position) and bench_rejected_step.png (PARSE). A bench plot
    of an earlier run that this result has none of is removed, so the folder never shows another run's figure."""
    figs = bench_figures(result)
    for name in set(BENCH_PLOTS) - set(figs):
        (Path(folder) / f"{name}.png").unlink(missing_ok=True)
    return [_save(fig, Path(folder) / f"{name}.png") for name, fig in figs.items()]


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher throughput and higher accuracy),
    sorted by throughput."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def _text_boxes(fig: Figure, renderer) -> list[Bbox]:
    return [t.get_window_extent(renderer) for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip() and t.figure is fig]


def label_points(ax, xy: Sequence[tuple[float, float]], labels: Sequence[str], fontsize: float = 8) -> list[str]:
    """Label each point (data coordinates) where its text overlaps no other text, no point marker and stays inside
    the axes: the first free spot on rings of growing radius around the point; a label away from its point gets a
    thin leader line. Points that sit on top of each other share one label ("0.05, 0.1"). A label that finds no
    spot goes into the legend instead. Call after everything else is drawn: the figure's layout is frozen here.
    Returns the labels that went into the legend."""
    fig = ax.figure
    _freeze_layout(fig)
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    pts = ax.transData.transform(np.asarray(xy, float).reshape(-1, 2))
    marker = 5.0 * fig.dpi / 72
    groups: list[list[int]] = []
    for i in np.argsort(pts[:, 0], kind="stable"):
        near = next((g for g in groups if np.hypot(*(pts[g[0]] - pts[i])) < marker), None)
        if near is None:
            groups.append([int(i)])
        else:
            near.append(int(i))
    taken = _text_boxes(fig, renderer) + [Bbox.from_extents(px - marker, py - marker, px + marker, py + marker)
                                          for px, py in pts]
    candidates = [(r * np.cos(a), r * np.sin(a)) for r in (6, 12, 20, 30, 42, 56, 72)
                  for a in np.radians([30, -30, 150, -150, 90, -90, 0, 180])]
    unplaced = []
    for g in groups:
        text = ", ".join(labels[i] for i in sorted(g))
        for dx, dy in candidates:
            ha = "left" if dx > 1 else "right" if dx < -1 else "center"
            va = "bottom" if dy > 1 else "top" if dy < -1 else "center"
            far = dx * dx + dy * dy > 15 ** 2
            t = ax.annotate(text, xy[g[0]], xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                            fontsize=fontsize,
                            arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6, shrinkA=0, shrinkB=3) if far else None)
            box = t.get_window_extent(renderer)
            fits = box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0 and box.y1 <= inside.y1
            if fits and not any(box.overlaps(o) for o in taken):
                taken.append(box)
                break
            t.remove()
        else:
            x, y = xy[g[0]]
            unplaced.append(f"{text}: {x:.0f}, {y:.1f}")
    if unplaced and ax.get_legend() is not None:  # no room near the points: list them beside the plot
        legend = ax.get_legend()
        handles = [*legend.legend_handles,
                   *[matplotlib.lines.Line2D([], [], ls="none") for _ in unplaced]]
        texts = [t.get_text() for t in legend.get_texts()] + unplaced
        ax.legend(handles, texts, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8)
    return unplaced


def sweep_figures(result: dict) -> dict[str, Figure]:
    """{"": speed-up and accuracy per value, "_pareto": accuracy vs tokens/s with the Pareto front}."""
    pts = result["points"]
    labels = [str(p["value"]) for p in pts]
    base = result["baseline"]
    x = np.arange(len(pts))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(9.0, 0.9 * len(pts) + 6), 4.3), layout="constrained")
    sp = [p["speedup_vs_target"] for p in pts]
    a.errorbar(x, sp, yerr=_errors(sp, [p["speedup_min"] for p in pts], [p["speedup_max"] for p in pts]),
               marker="o", capsize=4, color="tab:orange")
    top = max([p["speedup_max"] for p in pts] + [1.0])
    a.set_ylim(0, top * 1.1)
    _reference(a, 1.0, "target\n1.0x")
    a.set_ylabel("speed-up vs target (median; min-max)")
    acc = [100 * p["accuracy"] for p in pts]
    b.errorbar(x, acc, yerr=_errors(acc, [100 * p["accuracy_ci95"][0] for p in pts],
                                    [100 * p["accuracy_ci95"][1] for p in pts]), marker="o", capsize=4,
               color="tab:green")
    _reference(b, 100 * base["accuracy"], f"target\n{100 * base['accuracy']:.1f}%")
    b.set_ylabel("final-answer accuracy, % (95% CI)")
    for ax in (a, b):
        ax.set_xlim(-0.5, len(pts) - 0.5)
        _tick_labels(ax, labels)
        ax.set_xlabel(result["param"])
    fig.suptitle(f"{result['mode']}: sweep of {result['param']} ({result['n']} problems)")
    _freeze_layout(fig)
    figs = {"": fig}

    fig, ax = plt.subplots(figsize=(8.0, 4.8), layout="constrained")
    xy = [(p["tokens_per_s"], 100 * p["accuracy"]) for p in pts]
    everything = [*xy, (base["tokens_per_s"], 100 * base["accuracy"])]
    front = pareto_front(everything)
    fx, fy = [everything[i][0] for i in front], [everything[i][1] for i in front]
    # the front as the staircase it is: between two front points only the lower accuracy is reached
    ax.step(fx, fy, where="pre", color="tab:red", lw=1.2, zorder=1, label="Pareto front")
    ax.scatter(fx, fy, s=110, facecolors="none", edgecolors="tab:red", lw=1.2, zorder=3)
    ax.scatter([q[0] for q in xy], [q[1] for q in xy], color="tab:blue", zorder=2,
               label=f"{result['mode']}, one point per {result['param']}")
    ax.scatter([base["tokens_per_s"]], [100 * base["accuracy"]], marker="*", s=160, color=TARGET_COLOR, zorder=2,
               label="target")
    xs, ys = [q[0] for q in everything], [q[1] for q in everything]
    span_x, span_y = max(xs) - min(xs) or max(xs) * 0.1 or 1.0, max(ys) - min(ys) or 1.0
    ax.set_xlim(min(xs) - 0.15 * span_x, max(xs) + 0.15 * span_x)
    ax.set_ylim(min(ys) - 0.25 * span_y, max(ys) + 0.25 * span_y)
    ax.set_xlabel("tokens / s (median over repeats)")
    ax.set_ylabel("final-answer accuracy, %")
    ax.set_title(f"accuracy vs throughput over {result['param']} (circled: the Pareto front)", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8)
    label_points(ax, xy, labels)
    figs["_pareto"] = fig
    return figs


def sweep_plots(result: dict, folder: Path, stem: str) -> list[Path]:
    """STEM.png (speed-up and accuracy per value) and STEM_pareto.png (accuracy vs tokens/s, Pareto front)."""
    return [_save(fig, Path(folder) / f"{stem}{suffix}.png") for suffix, fig in sweep_figures(result).items()]


def block_cost_figure(rows: Sequence[dict], title: str = "What a block of T new tokens costs") -> Figure:
    """One panel per batch size: the cost of one pass over T new tokens in one-token steps, per model (rows of
    `benchmarks/bench_block_cost.py`: batch, block, us, optional `model`: target, draft, eagle3 head, ...).
    Speculation that proposes T - 1 tokens pays only well below the dashed line y = T."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    batches = sorted({int(r["batch"]) for r in rows})
    models = list(dict.fromkeys(r.get("model", "target") for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(4.8 * len(batches) + 1.0, 4.4), layout="constrained",
                             squeeze=False)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    labels = []
    for ax, batch in zip(axes[0], batches):
        blocks: set[int] = {1}
        points, values = [], []
        for model in models:
            mine = sorted((r for r in rows if int(r["batch"]) == batch and r.get("model", "target") == model),
                          key=lambda r: r["block"])
            one = next((r["us"] for r in mine if r["block"] == 1), None)
            if not mine or one is None:
                continue
            ts = [int(r["block"]) for r in mine]
            ratios = [r["us"] / one for r in mine]
            blocks.update(ts)
            ax.plot(ts, ratios, marker="o", label=f"{model} (one step: {one / 1000:.2f} ms)", zorder=3)
            points += [(t, v) for t, v in zip(ts, ratios) if t > 1]
            values += [f"{v:.1f}" for t, v in zip(ts, ratios) if t > 1]
        grid = np.array([1, max(blocks)])
        ax.plot(grid, grid, color=TARGET_COLOR, ls="--", lw=1, label="T one-token steps: no gain")
        ax.axhline(1.0, color=TARGET_COLOR, ls=":", lw=1, label="one step: a free block")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(sorted(blocks))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.set_ylim(0.7, max(blocks) * 1.6)
        ax.set_xlim(0.8, max(blocks) * 1.25)
        ax.set_xlabel("new tokens in the block, T")
        ax.set_ylabel("cost of the block, in one-token steps")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
        labels.append((ax, points, values))
    fig.suptitle(title)
    for ax, points, values in labels:  # last: placing labels freezes the layout
        label_points(ax, points, values, fontsize=7)
    _freeze_layout(fig)
    return fig


def block_cost_plot(rows: Sequence[dict], path: str | Path, title: str = "What a block of T new tokens costs") -> Path:
    """block_cost_figure written as a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(block_cost_figure(rows, title), path)
