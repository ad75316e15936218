"""`parse-jax bench`: every mode on the same held-out problems, in one process, interleaved and repeated.

Timing is wall-clock around each mode's generate call (host work included), after one untimed warm-up call
per mode and batch shape, so compilation is not counted. Speed-ups are ratios of tokens/s against `target`
within the same repeat; the table shows their median and range over repeats. Passes are counted per request
(a batched pass counts once for each row it serves): "accepted / pass" is accepted draft tokens per request per
verification (per target round in `sd`), "target passes / 100 tok" is target passes per request per 100 tokens.

Modes are the engine's (`engine.MODES`, so new ones appear here by themselves) plus two bench-only names:
`parse-multi`, PARSE with `rounds="multi"` (plain `parse` is always single round here, so both can run side
by side in one bench), and `draft`, the draft alone (the ceiling if every draft were accepted for free).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from parse_jax.engine import ParseEngine
from parse_jax.errors import ConfigError
from parse_jax.harness.provenance import format_provenance, provenance
from parse_jax.harness.runs import (
    check_modes,
    check_run_settings,
    format_row,
    measure,
    mode_runner,
    write_json,
    write_text,
)
from parse_jax.runtime.programs import compiled_programs
from parse_jax.utils.atomic import check_writable
from parse_jax.utils.progress import logger


def run_bench(eng: ParseEngine, task, n: int = 100, modes: Sequence[str] = ("target", "sequential", "parse"),
              max_new_tokens: int = 64, batch_size: int = 16, repeats: int = 3, seed: int = 0,
              progress: bool = True, log: Callable[[str], None] = print, models: dict | None = None,
              skip_unavailable: bool = False, eos_ids: Sequence[int] | None = None) -> dict:
    """Every mode in `modes` (plus `target`, the baseline) on `n` held-out problems of `task`: the bench result.

    `skip_unavailable`: drop (and say so) a mode this pair cannot run (a ConfigError on a first call, e.g. a mode
    that needs a head the pair lacks) instead of failing: what `--modes all` wants. `eos_ids`: the stop ids
    (default: the models' own). `task` may be the embedded task or a `parse_jax.harness.eval.data.DataTask` (--data)."""
    modes = check_modes(modes)
    if "target" not in modes:
        modes = ["target", *modes]  # the baseline every speed-up is measured against
    check_run_settings(n, max_new_tokens, batch_size, repeats, seed)
    problems = task.problems(n, seed)
    runners, skipped = {}, {}
    probe = tqdm(modes, desc="checking which modes run (one short call each)", unit="mode",
                 disable=not (progress and skip_unavailable))
    for m in probe:
        probe.set_postfix_str(m)
        try:
            runners[m] = mode_runner(eng.target, eng.draft, eng.config, m, eos_ids=eos_ids)
            if skip_unavailable and m != "target":
                runners[m]([problems[0][0]], 1, seed)
        except ConfigError as e:
            if not skip_unavailable or m == "target":
                raise
            runners.pop(m, None)
            skipped[m] = str(e)
            logger.warning(f"skipping mode {m}: {e}")
    rows = measure(runners, task, problems, max_new_tokens, batch_size, repeats, seed, progress=progress)
    settings = {"n": n, "max_new_tokens": max_new_tokens, "batch_size": batch_size, "repeats": repeats,
                "seed": seed, "task": getattr(task, "name", None), "split": getattr(task, "split", "test"),
                "temperature": 0.0, "eos_ids": None if eos_ids is None else list(eos_ids)}
    if getattr(task, "data", None) is not None:
        settings["data"], settings["data_sha256"] = task.data, task.data_sha256
    config = {**settings, "parse_config": dataclasses.asdict(eng.config), "models": models}
    result = {"modes": rows, **settings, "parse_config": dataclasses.asdict(eng.config),
              "provenance": provenance(config, seed), "compiled_programs": compiled_programs()}
    if skipped:
        result["skipped_modes"] = skipped
    if "draft" in rows and "parse" in rows:
        result["parse_fraction_of_draft_only"] = rows["parse"]["tokens_per_s"] / rows["draft"]["tokens_per_s"]
    log(format_table(result))
    return result



def format_table(result: dict) -> str:
    """The bench table (Markdown); one row per mode."""
    lines = ["| mode | tok/s | speed-up vs target (min-max) | accuracy (95% CI) | accepted / pass | "
             "target passes / 100 tok |", "|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        lines.append(format_row(mode, r))
    return "\n".join(lines)



def bench_markdown(result: dict) -> str:
    """bench.md: settings, the table, provenance."""
    lines = ["# parse-jax bench", ""]
    if result.get("command"):
        lines += [f"Command: `{result['command']}`", ""]
    lines += [f"{result['n']} held-out problems of task `{result.get('task')}`, batches of {result['batch_size']}, "
              f"{result['repeats']} repeats interleaved, greedy, at most {result['max_new_tokens']} new tokens. "
              "Speed-up: median (min-max) over repeats of tokens/s against `target` in the same repeat; "
              "accuracy: final answers, 95% Wilson interval.", "", format_table(result), ""]
    if "parse_fraction_of_draft_only" in result:
        lines += [f"PARSE reaches {100 * result['parse_fraction_of_draft_only']:.1f}% of the draft-only throughput.",
                  ""]
    for mode, why in result.get("skipped_modes", {}).items():
        lines += [f"Skipped `{mode}`: {why}", ""]
    lines += [format_provenance(result["provenance"]), ""]
    return "\n".join(lines)



def write_bench(result: dict, folder: str | Path) -> list[Path]:
    """bench.json, bench.md and the PNG plots into `folder`."""
    from parse_jax.harness.plots import bench_plots

    folder = Path(check_writable(folder))
    paths = [write_json(result, folder / "bench.json"), write_text(folder / "bench.md", bench_markdown(result))]
    return paths + bench_plots(result, folder)
