"""The pictures: written as PNGs and legible. No two text elements of a figure overlap (matplotlib's own text boxes,
measured with the renderer), the draft-alone ceiling sits in its own panel, the target is a dashed line labelled
"target", and the Pareto front is drawn through the points that are on it."""

import itertools
from unittest import mock

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.text import Text

from parse_jax.harness.plots import (
    bench_figures,
    bench_plots,
    block_cost_figure,
    block_cost_plot,
    pareto_front,
    sweep_figures,
    sweep_plots,
)
from parse_jax.harness.runs import BENCH_MODES

SEEDS = [0, 1, 2]


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of drawn, non-empty texts whose boxes share more than one square pixel. Only texts the renderer really
    draws count (an axis keeps labels for ticks outside its view, which are never drawn)."""
    drawn = []
    draw = Text.draw

    def recording_draw(self, renderer):
        drawn.append(self)
        return draw(self, renderer)

    with mock.patch.object(Text, "draw", recording_draw):
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn if t.get_visible() and t.get_text().strip()]
    assert boxes, "nothing drawn"
    bad = []
    for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        if w > 1 and h > 1:
            bad.append((ta, tb))
    return bad


def test_the_overlap_check_sees_overlaps():
    fig, ax = plt.subplots()
    ax.text(0.5, 0.5, "one label")
    ax.text(0.51, 0.5, "another label")
    assert ("one label", "another label") in overlapping_texts(fig)
    plt.close(fig)


def bench_result(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    modes = {}
    for m in BENCH_MODES:
        tps = float(rng.uniform(300, 1500)) if m != "draft" else float(rng.uniform(8000, 50000))
        all_tps = sorted([tps * rng.uniform(0.5, 1.0), tps, tps * rng.uniform(1.0, 1.1)])
        acc = float(rng.uniform(0.9, 1.0)) if m != "draft" else 0.5
        modes[m] = {"tokens_per_s": tps, "tokens_per_s_all": all_tps, "accuracy": acc,
                    "accuracy_ci95": [max(acc - 0.05, 0), min(acc + 0.02, 1.0)]}
    base = modes["target"]["tokens_per_s"]
    for r in modes.values():
        r["speedup_vs_target"] = r["tokens_per_s"] / base
        r["speedup_min"], r["speedup_max"] = r["tokens_per_s_all"][0] / base, r["tokens_per_s_all"][-1] / base
    return {"modes": modes, "n": 300, "batch_size": 1, "repeats": 3}


@pytest.mark.parametrize("seed", SEEDS)
def test_bench_figures_are_legible_and_keep_the_ceiling_apart(seed):
    res = bench_result(seed)
    figs = bench_figures(res)
    assert set(figs) == {"bench_throughput", "bench_accuracy"}
    for name, fig in figs.items():
        assert overlapping_texts(fig) == [], name
    tput, speed, ceiling = figs["bench_throughput"].axes
    main_modes = [m for m in BENCH_MODES if m != "draft"]
    assert [t.get_text() for t in speed.get_xticklabels()] == main_modes
    assert [t.get_text() for t in ceiling.get_xticklabels()] == ["draft"]
    # the ceiling does not set the other panels' scale
    assert speed.get_ylim()[1] <= 1.3 * max(max(res["modes"][m]["speedup_max"] for m in main_modes), 1.0)
    assert speed.get_ylim()[1] < res["modes"]["draft"]["speedup_vs_target"]
    for ax in (speed, ceiling):
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--" and set(ln.get_ydata()) == {1.0}]
        assert dashed, "no dashed 1.0x line"
        assert any(t.get_text().startswith("target") for t in ax.texts)
    values = {t.get_text() for t in speed.texts}
    assert f"{res['modes']['parse']['speedup_vs_target']:.2f}x" in values  # every bar says its value
    for fig in figs.values():
        plt.close(fig)


def sweep_result(seed: int, n: int = 10) -> dict:
    rng = np.random.default_rng(seed)
    pts = []
    for i in range(n):  # clustered: several points almost on top of each other
        tps = float(600 + 5 * rng.integers(0, 4) + rng.uniform(0, 2))
        acc = float(rng.choice([0.99, 1.0]))
        pts.append({"value": f"{0.1 * i + 0.05:g}", "tokens_per_s": tps, "speedup_vs_target": tps / 900,
                    "speedup_min": tps / 1000, "speedup_max": tps / 800, "accuracy": acc,
                    "accuracy_ci95": [acc - 0.04, min(acc + 0.01, 1.0)]})
    base = {"tokens_per_s": 900.0, "accuracy": 0.985}
    return {"points": pts, "baseline": base, "param": "threshold", "mode": "parse", "n": 200}


@pytest.mark.parametrize("seed", SEEDS)
def test_sweep_figures_have_no_overlapping_labels_and_draw_the_front(seed):
    res = sweep_result(seed)
    figs = sweep_figures(res)
    for name, fig in figs.items():
        assert overlapping_texts(fig) == [], name
    ax = figs["_pareto"].axes[0]
    everything = [(p["tokens_per_s"], 100 * p["accuracy"]) for p in res["points"]]
    everything.append((res["baseline"]["tokens_per_s"], 100 * res["baseline"]["accuracy"]))
    front = [everything[i] for i in pareto_front(everything)]
    assert len(front) >= 2  # the target is faster, PARSE more accurate: both are on it
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "Pareto front")
    vertices = set(zip(np.round(line.get_xdata(), 6), np.round(line.get_ydata(), 6)))
    assert {(round(x, 6), round(y, 6)) for x, y in front} <= vertices
    labelled = " ".join(t.get_text() for t in ax.texts)
    legend = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    for p in res["points"]:  # every value is named, beside its point or in the legend
        assert p["value"] in labelled or p["value"] in legend
    for fig in figs.values():
        plt.close(fig)


def test_block_cost_figure_draws_every_model(tmp_path):
    rows = []
    for model, step in (("target", 600.0), ("draft", 70.0), ("eagle3", 130.0)):
        for batch in (1, 16):
            for t in (1, 2, 6, 16, 48):
                rows.append({"model": model, "batch": batch, "block": t, "us": step * batch ** 0.5 * t ** 0.6})
    fig = block_cost_figure(rows)
    assert overlapping_texts(fig) == []
    assert len(fig.axes) == 2
    for ax in fig.axes:
        names = [ln.get_label() for ln in ax.get_lines()]
        assert sum(n.startswith(("target", "draft", "eagle3")) for n in names) == 3
    plt.close(fig)
    rows_without_model = [{k: v for k, v in r.items() if k != "model"} for r in rows if r["model"] == "target"]
    path = block_cost_plot(rows_without_model, tmp_path / "sub" / "block_cost.png")  # old rows: target only
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("seed", SEEDS)
def test_acceptance_per_position_and_the_rejected_step_histogram_are_legible(seed):
    rng = np.random.default_rng(seed)
    res = bench_result(seed)
    for m, gamma in (("sd", 4), ("eagle3", 5)):
        rates = np.sort(rng.uniform(0.05, 0.95, gamma))[::-1]
        res["modes"][m].update(acceptance_rate_per_pos=rates.tolist(), acceptance_length=1 + float(rates.sum()))
    hist = rng.integers(0, 40, 9).tolist()
    res["modes"]["parse"]["first_rejected_step_hist"] = hist
    figs = bench_figures(res)
    assert set(figs) == {"bench_throughput", "bench_accuracy", "bench_acceptance", "bench_rejected_step"}
    for name, fig in figs.items():
        assert overlapping_texts(fig) == [], name
    (ax,) = figs["bench_acceptance"].axes
    assert [list(ln.get_ydata()) for ln in ax.get_lines()] == [res["modes"][m]["acceptance_rate_per_pos"]
                                                               for m in ("sd", "eagle3")]
    (bars,) = figs["bench_rejected_step"].axes
    heights = [p.get_height() for p in bars.patches]
    assert heights == pytest.approx([100 * h / sum(hist) for h in hist])
    assert [t.get_text() for t in bars.get_xticklabels()] == [str(k) for k in range(1, 9)] + ["none"]
    plt.close("all")


def test_plots_are_written(tmp_path):
    paths = bench_plots(bench_result(0), tmp_path) + sweep_plots(sweep_result(0), tmp_path, "sweep_threshold")
    assert sorted(p.name for p in paths) == ["bench_accuracy.png", "bench_throughput.png", "sweep_threshold.png",
                                              "sweep_threshold_pareto.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    without_draft = bench_result(1)
    del without_draft["modes"]["draft"]
    assert len(bench_figures(without_draft)["bench_throughput"].axes) == 2
    plt.close("all")


def test_a_rerun_removes_the_plots_it_has_none_of(tmp_path):
    """Another run's acceptance plot does not stay beside a bench that ran no token-level speculation; files that
    are not bench plots stay."""
    for name in ("bench_acceptance.png", "bench_rejected_step.png", "notes.png"):
        (tmp_path / name).write_bytes(b"old")
    bench_plots(bench_result(0), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_accuracy.png", "bench_throughput.png", "notes.png"]
    plt.close("all")
