"""Parameter sweeps of PARSE against the target, and threshold calibration on a dev split.

A sweep runs `target` once (the baseline) and one PARSE engine per value, all on the same problems in one process,
interleaved and repeated exactly as `parse-jax bench` does (`bench.measure`).

Calibration needs problems the test numbers never see. The embedded task splits problems by a hash of the prompt:
`split="test"` (10%, what bench and sweeps draw) and `split="train"` (the rest). `calibrate` draws its dev problems
from the train split, so a threshold chosen here cannot leak into held-out results (the pair may have trained on
some of them, which makes the dev accuracies optimistic for both target and PARSE alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError, InputError
from parse_jax.harness.provenance import format_provenance, provenance
from parse_jax.harness.runs import (
    RunSettings,
    format_row,
    measure,
    mode_runner,
    ran_text,
    recorded_settings,
    runnable_problems,
    sampling_text,
    write_json,
    write_text,
)
from parse_jax.modes.table import MODE_TABLE
from parse_jax.utils.atomic import check_writable
from parse_jax.utils.validation import check_float

SWEEP_PARAMS = ("threshold", "max_prefixes", "segmenter", "max_draft_tokens")
DEFAULT_THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
DEV_SPLIT = "train"
SWEEP_SETTINGS = RunSettings(max_new_tokens=32)  # run_sweep's defaults
CALIBRATE_SETTINGS = RunSettings(n=200, max_new_tokens=32)  # calibrate's defaults


def parse_value(param: str, text: str) -> dict:
    """ParseConfig overrides for one sweep value. segmenter values: delimiter, hybrid, stride or stride:DELTA."""
    text = text.strip()
    try:
        if param == "threshold":
            value = float(text)
        if param in ("max_prefixes", "max_draft_tokens"):
            return {param: int(text)}
    except ValueError:
        raise InputError(f"--values for {param} must be numbers, got {text!r}") from None
    if param == "threshold":
        return {"threshold": check_float("threshold", value, 0.0, 1.0, error=InputError)}
    if param == "segmenter":
        name, _, delta = text.partition(":")
        if delta:
            if name != "stride":
                raise InputError(f"only the stride segmenter takes a value (stride:DELTA), got {text!r}")
            try:
                return {"segmenter": "stride", "stride": int(delta)}
            except ValueError:
                raise InputError(f"stride:DELTA needs an integer DELTA, got {text!r}") from None
        return {"segmenter": name}
    raise InputError(f"unknown sweep parameter {param!r}; available: {', '.join(SWEEP_PARAMS)}")


def sweep_configs(base: ParseConfig, param: str, values: Sequence[str]) -> list[tuple[str, dict, ParseConfig]]:
    """(label, overrides, config) per value; every config is built (and validated) before any work starts."""
    if not values:
        raise InputError("a sweep needs at least one value")
    out = []
    for v in values:
        overrides = parse_value(param, str(v))
        try:
            config = dataclasses.replace(base, **overrides)
        except ConfigError as e:  # the value's own check, named as the user gave it
            raise type(e)(f"--values for {param}: {str(v).strip()!r}: {e}") from None
        out.append((str(v).strip(), overrides, config))
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise InputError(f"repeated sweep values: {labels}")
    return out


@dataclasses.dataclass(frozen=True)
class SweepBase:
    """What a sweep reads of an engine: its models, and the config each value is applied over."""

    target: Any
    draft: Any
    config: ParseConfig


# the modes a PARSE setting (threshold, prefixes, segmenter, draft length) changes: those whose target judges drafts
SWEEP_MODES = tuple(label for spec in MODE_TABLE.values() if spec.judged for label in spec.bench_labels)


def check_sweep_mode(mode: str) -> None:
    """A sweep or a calibration varies a PARSE setting: in another mode (sd, eagle3, the target) it changes nothing,
    and each value would measure the same run."""
    if mode not in SWEEP_MODES:
        raise InputError(f"--mode {mode!r}: sweep and calibrate vary a PARSE setting, which only the modes that judge "
                         f"drafts read; allowed: {', '.join(SWEEP_MODES)}")


def run_sweep(eng: ParseEngine | SweepBase, task, param: str, values: Sequence[str],
              settings: RunSettings = SWEEP_SETTINGS, *, mode: str = "parse", split: str = "test",
              models: dict | None = None) -> dict:
    """`target` once, then `mode` with each value of `param` over `eng.config`, on the same `settings.n` problems
    of `split` (a --data `DataTask` has one split: its file)."""
    target, draft, base = eng.target, eng.draft, eng.config
    check_sweep_mode(mode)
    configs = sweep_configs(base, param, values)
    sampling = {"temperature": settings.temperature, "eos_ids": settings.eos_ids}
    runners = {"target": mode_runner(target, draft, base, "target", **sampling)}
    for label, _, cfg in configs:
        runners[f"{param}={label}"] = mode_runner(target, draft, cfg, mode, **sampling)
    split = getattr(task, "split", split)
    problems = task.problems(settings.n, settings.seed, split=split)
    task, problems, settings = runnable_problems(task, runners, problems, settings)
    rows = measure(runners, task, problems, settings)
    recorded = {"param": param, "values": [label for label, _, _ in configs], "mode": mode,
                **recorded_settings(settings, task, split)}
    config = {**recorded, "parse_config": dataclasses.asdict(base), "models": models}
    points = [{"value": label, "overrides": overrides, **rows[f"{param}={label}"]} for label, overrides, _ in configs]
    return {**recorded, "parse_config": dataclasses.asdict(base), "baseline": rows["target"], "points": points,
            "prompts": [p for p, _ in problems], "provenance": provenance(config, settings.seed)}


def sweep_table(result: dict) -> str:
    lines = [f"| {result['param']} | tok/s | speed-up vs target (min-max) | accuracy (95% CI) | accepted / pass | "
             "target passes / 100 tok |", "|---|---|---|---|---|---|", format_row("target", result["baseline"])]
    lines += [format_row(p["value"], p) for p in result["points"]]
    return "\n".join(lines)


def sweep_markdown(result: dict, title: str) -> str:
    lines = [f"# {title}", ""]
    if result.get("command"):
        lines += [f"Command: `{result['command']}`", ""]
    lines += [f"`{result['mode']}` with each value of `{result['param']}` against `target`, on the same "
              f"{result['n']} problems (split `{result['split']}`) of task `{result.get('task')}`: batches of "
              f"{result['batch_size']}, {result['repeats']} repeats interleaved, {sampling_text(result)}, at most "
              f"{result['max_new_tokens']} new tokens.", "", sweep_table(result), ""]
    ran = [f"{p['value']}: {text}" for p, text in ((p, ran_text(p)) for p in result["points"]) if text]
    if ran:  # schedule="auto": a value whose runs decoded plainly measured the target, not its PARSE setting
        lines += ["What `schedule=\"auto\"` ran for each value in the timed repeats (decisions per choice, summed "
                  "over the repeats: a served run decides once, and once more per window it explores or measures "
                  "again; `target`: plain decoding, where the cost model or a measurement said speculation would "
                  "lose at this batch size): " + "; ".join(ran) + ".", ""]
    if "calibration" in result:
        c = result["calibration"]
        lines += [c["message"], ""]
    lines += [format_provenance(result["provenance"]), ""]
    return "\n".join(lines)


def write_sweep(result: dict, folder: str | Path, stem: str | None = None, title: str | None = None) -> list[Path]:
    """STEM.json, STEM.md and the PNG plots (per value; accuracy vs throughput Pareto) into `folder`."""
    from parse_jax.harness.plots import sweep_plots

    folder = Path(check_writable(folder))
    stem = stem or f"sweep_{result['param']}"
    paths = [write_json(result, folder / f"{stem}.json"),
             write_text(folder / f"{stem}.md", sweep_markdown(result, title or f"Sweep of {result['param']}"))]
    return paths + sweep_plots(result, folder, stem)


CALIBRATED_CONFIG = "parse_config.yaml"  # calibrate's settings with the threshold it chose (`ParseConfig.load`)


def pick_threshold(result: dict, tolerance: float) -> dict:
    """From a threshold sweep: among thresholds whose accuracy is within `tolerance` of the target's, the one that
    accepts the most draft tokens; among equals, the highest (strictest) threshold.

    Accepted tokens, not tokens/s: greedy acceptance is deterministic and is what makes PARSE fast, while wall-clock
    medians on a shared machine move by more than the differences between neighbouring thresholds. Returns
    {"threshold": float | None, "eligible": [...], "message": str, ...}; None when no value qualifies."""
    if result["param"] != "threshold":
        raise InputError(f"calibration needs a threshold sweep, got one of {result['param']!r}")
    base = result["baseline"]["accuracy"]
    eligible = [p for p in result["points"] if p["accuracy"] >= base - tolerance - 1e-12]
    if not eligible:
        best = max(result["points"], key=lambda p: p["accuracy"])
        return {"threshold": None, "eligible": [], "tolerance": tolerance, "target_accuracy": base,
                "message": f"no threshold keeps accuracy within {100 * tolerance:g} points of the target's "
                           f"{100 * base:.1f}% on the dev split; the best, {best['value']}, reached "
                           f"{100 * best['accuracy']:.1f}%"}
    chosen = max(eligible, key=lambda p: (p["accepted_tokens"], float(p["value"])))
    return {"threshold": float(chosen["value"]), "eligible": [p["value"] for p in eligible], "tolerance": tolerance,
            "target_accuracy": base, "accuracy": chosen["accuracy"], "accepted_tokens": chosen["accepted_tokens"],
            "tokens_per_s": chosen["tokens_per_s"], "speedup_vs_target": chosen["speedup_vs_target"],
            "message": f"threshold {chosen['value']}: accuracy {100 * chosen['accuracy']:.1f}% vs the target's "
                       f"{100 * base:.1f}% (tolerance {100 * tolerance:g} points) on {result['n']} dev problems; "
                       f"it accepts {chosen['accepted_tokens']} draft tokens, the most of the {len(eligible)} eligible "
                       f"value(s) (the strictest among equals); {chosen['tokens_per_s']:.1f} tok/s = "
                       f"{chosen['speedup_vs_target']:.2f}x the target"}


def calibrate(eng: ParseEngine, task, settings: RunSettings = CALIBRATE_SETTINGS, *, tolerance: float = 0.01,
              thresholds: Sequence[float] = DEFAULT_THRESHOLDS, mode: str = "parse",
              log: Callable[[str], None] = print, models: dict | None = None) -> dict:
    """A threshold sweep on dev problems (never the held-out test split), PARSE run as configured whatever the
    engine's schedule, then `pick_threshold`."""
    check_float("tolerance", tolerance, 0.0, 1.0, max_open=True, error=InputError)
    if not thresholds:
        raise ConfigError("no thresholds to calibrate over")
    for t in thresholds:
        check_float("threshold", t, 0.0, 1.0)
    # the threshold is a property of the verification: every candidate runs PARSE as configured (schedule "fixed"),
    # or at a batch size where the schedule decodes plainly no candidate would be measured at all
    fixed = SweepBase(eng.target, eng.draft, dataclasses.replace(eng.config, schedule="fixed"))
    result = run_sweep(fixed, task, "threshold", [f"{t:g}" for t in thresholds], settings, mode=mode,
                       split=DEV_SPLIT, models=models)
    result["calibration"] = pick_threshold(result, tolerance)
    log(sweep_table(result))
    return result
