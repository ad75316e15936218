"""`parse-jax bench`: every mode on the same held-out problems, in one process, interleaved and repeated.

Timing is wall-clock around each mode's generate call (host work included), after one untimed warm-up call
per mode and batch shape, so compilation is not counted. Speed-ups are ratios of tokens/s against `target`
within the same repeat; the table shows their median and range over repeats. Passes are counted per request
(a batched pass counts once for each row it serves): "accepted / pass" is accepted draft tokens per request per
verification (per target round in `sd`), "target passes / 100 tok" is target passes per request per 100 tokens
(0 in the `draft` row: the target makes none there).

Modes are the mode table's (`parse_jax.modes.table.MODE_TABLE`, so new ones appear here by themselves): each
mode by name, the multi-round run of a mode that honours `rounds` under its `multi_label` (`parse-multi`: plain
`parse` is always single round here, so both can run side by side in one bench), and `draft`, the draft alone
(the ceiling if every draft were accepted for free).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from parse_jax.engine import ParseEngine
from parse_jax.errors import ConfigError, InputError
from parse_jax.harness.provenance import format_provenance, provenance
from parse_jax.harness.runs import (
    RunSettings,
    check_modes,
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
from parse_jax.runtime.programs import compiled_programs
from parse_jax.utils.atomic import check_writable
from parse_jax.utils.progress import logger

BENCH_SETTINGS = RunSettings()  # run_bench's defaults


def run_bench(eng: ParseEngine, task, settings: RunSettings = BENCH_SETTINGS, *,
              modes: Sequence[str] = ("target", "sequential", "parse"), log: Callable[[str], None] = print,
              models: dict | None = None, skip_unavailable: bool = False) -> dict:
    """Every mode in `modes` (plus `target`, the baseline) on `settings.n` held-out problems of `task`: the bench
    result.

    `skip_unavailable`: drop (and say so) a mode this pair cannot run (a ConfigError on a first call, e.g. a mode
    that needs a head the pair lacks) instead of failing: what `--modes all` wants. `task` may be the embedded task
    or a `parse_jax.harness.eval.results.DataTask` (--data)."""
    modes = check_modes(modes)
    if "target" not in modes:
        modes = ["target", *modes]  # the baseline every speed-up is measured against
    problems = task.problems(settings.n, settings.seed)
    runners, skipped = {}, {}
    probe = tqdm(modes, desc="checking which modes run (one short call each)", unit="mode",
                 disable=not (settings.progress and skip_unavailable))
    for m in probe:
        probe.set_postfix_str(m)
        try:
            runners[m] = mode_runner(eng.target, eng.draft, eng.config, m, temperature=settings.temperature,
                                     eos_ids=settings.eos_ids)
            if skip_unavailable and m != "target":
                probe_call(runners[m], problems[0][0], settings.seed)
        except ConfigError as e:  # a mode this pair cannot run (a head it lacks)
            if not skip_unavailable or m == "target":
                raise
            runners.pop(m, None)
            skipped[m] = str(e)
            logger.warning(f"skipping mode {m}: {e}")
    task, problems, settings = runnable_problems(task, runners, problems, settings)  # --data records, up front
    rows = measure(runners, task, problems, settings)
    recorded = recorded_settings(settings, task)
    config = {**recorded, "parse_config": dataclasses.asdict(eng.config), "models": models}
    result = {"modes": rows, **recorded, "parse_config": dataclasses.asdict(eng.config),
              "provenance": provenance(config, settings.seed), "compiled_programs": compiled_programs()}
    if skipped:
        result["skipped_modes"] = skipped
    if "draft" in rows and "parse" in rows:
        result["parse_fraction_of_draft_only"] = rows["parse"]["tokens_per_s"] / rows["draft"]["tokens_per_s"]
    log("\n".join([format_table(result), *run_notes(result)]))
    return result



def format_table(result: dict) -> str:
    """The bench table (Markdown); one row per mode."""
    lines = ["| mode | tok/s | speed-up vs target (min-max) | accuracy (95% CI) | accepted / pass | "
             "target passes / 100 tok |", "|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        lines.append(format_row(mode, r))
    return "\n".join(lines)



def run_notes(result: dict) -> list[str]:
    """What a reader needs to read the table right: what `schedule="auto"` ran in the timed repeats (a mode that
    decoded plainly measured the target's program, not itself), and the modes whose timing holds compiles."""
    notes = []
    ran = [f"{mode}: {text}" for mode, text in ((mode, ran_text(r)) for mode, r in result["modes"].items()) if text]
    if ran:
        notes.append("What `schedule=\"auto\"` ran in the timed repeats (decisions per choice, summed over the "
                     "repeats: a served run decides once, and once more per window it explores or measures again; "
                     "`target`: plain decoding, where the cost model or a measurement said speculation would lose "
                     "at this batch size): " + "; ".join(ran) + ".")
    compiled = [f"{mode} {r['compiles_in_timing']}" for mode, r in result["modes"].items()
                if r.get("compiles_in_timing")]
    if compiled:
        notes.append("Programs compiled inside the timed runs (those figures include compiling): "
                     + ", ".join(compiled) + ".")
    return notes


def bench_markdown(result: dict) -> str:
    """bench.md: settings, the table, provenance."""
    lines = ["# parse-jax bench", ""]
    if result.get("command"):
        lines += [f"Command: `{result['command']}`", ""]
    lines += [f"{result['n']} held-out problems of task `{result.get('task')}`, batches of {result['batch_size']}, "
              f"{result['repeats']} repeats interleaved, {sampling_text(result)}, at most "
              f"{result['max_new_tokens']} new tokens. "
              "Speed-up: median (min-max) over repeats of tokens/s against `target` in the same repeat; "
              "accuracy: final answers, 95% Wilson interval.", "", format_table(result), ""]
    if "parse_fraction_of_draft_only" in result:
        lines += [f"PARSE reaches {100 * result['parse_fraction_of_draft_only']:.1f}% of the draft-only throughput.",
                  ""]
    for note in run_notes(result):
        lines += [note, ""]
    for mode, why in result.get("skipped_modes", {}).items():
        lines += [f"Skipped `{mode}`: {why}", ""]
    lines += [format_provenance(result["provenance"]), ""]
    return "\n".join(lines)



def probe_call(runner, prompt, seed: int) -> None:
    """One short call of a mode: a ConfigError says the pair cannot run it; the prompt's own trouble (an
    InputError) is left to `runnable_problems`, which reports the records."""
    try:
        runner([prompt], 1, seed, None)
    except InputError:
        pass


def write_bench(result: dict, folder: str | Path) -> list[Path]:
    """bench.json, bench.md and the PNG plots into `folder`."""
    from parse_jax.harness.plots import bench_plots

    folder = Path(check_writable(folder))
    paths = [write_json(result, folder / "bench.json"), write_text(folder / "bench.md", bench_markdown(result))]
    return paths + bench_plots(result, folder)
