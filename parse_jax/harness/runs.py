"""What bench, sweep, calibrate and eval share: the modes a run may name, a runner per mode, the checks of run
settings, and `measure` (every mode on the same problems, interleaved and repeated, timed after a warm-up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError, InputError
from parse_jax.harness.eval.report import wilson
from parse_jax.modes.table import MODE_TABLE
from parse_jax.runtime import executables
from parse_jax.runtime.decode import generate, target_request
from parse_jax.runtime.metrics import combine
from parse_jax.runtime.programs import compiled_programs, setup_events
from parse_jax.runtime.requests import GenerateResult, SamplingParams
from parse_jax.runtime.slots import admission_warm_up, serve_request
from parse_jax.schedule.auto import EXPLORING, option
from parse_jax.settings import BATCHING, DEFAULT_BATCHING, Batching, check_config
from parse_jax.utils import atomic, compile_cache
from parse_jax.utils.validation import check_choice, check_eos_ids, check_float, check_int, check_seed

DRAFT_ALONE = "draft"  # bench-only: the draft model alone (what PARSE's draft costs by itself)

# every bench name: the engine's modes, the multi-round runs of those that honour `rounds`, then the draft alone
BENCH_MODES = (*MODE_TABLE, *(s.multi_label for s in MODE_TABLE.values() if s.multi_label), DRAFT_ALONE)
WARM_UP_CALLS = 8  # per runner and chunk shape: an auto engine explores, measures and serves up to 3 choices


# (prompts, max_new_tokens, seed (one for the call, or one per prompt), max_batch) -> GenerateResult; max_batch: at most
# that many rows at once (None: all)
Runner = Callable[[list, int, "int | list[int]", "int | None"], GenerateResult]



def check_modes(modes: Sequence[str]) -> list[str]:
    """The requested modes, deduplicated, in order ("all" = every bench mode); an unknown one is an InputError."""
    expanded: list[str] = []
    for m in modes:
        expanded += list(BENCH_MODES) if m == "all" else [m]
    modes = list(dict.fromkeys(expanded))
    unknown = [m for m in modes if m not in BENCH_MODES]
    if not any(m.strip() for m in modes):
        raise InputError(f"modes is empty; give one or more of: {', '.join(BENCH_MODES)} (or all)")
    if unknown:
        raise InputError(f"unknown mode(s) {unknown}; available: {', '.join(BENCH_MODES)} (or all)")
    return modes



def mode_config(config: ParseConfig, mode: str, *, honour_rounds: bool = False) -> tuple[ParseConfig, str]:
    """(config, engine mode) a bench mode runs with: a mode's `multi_label` (parse-multi) is that mode with
    rounds="multi"; a mode that honours rounds, by its own name, is single round (so that `parse` and `parse-multi`
    side by side in a bench are the two), unless `honour_rounds` (eval, `pj.evaluate`, lm-eval: one mode, whose
    config's rounds, where set to "single" or "multi", are never overridden); the rest run as they are."""
    for spec in MODE_TABLE.values():
        if spec.honours_rounds and mode in spec.bench_labels:
            rounds = "multi" if mode == spec.multi_label else "single"
            if honour_rounds and mode == spec.name and config.rounds != "auto":
                rounds = config.rounds
            return dataclasses.replace(config, rounds=rounds), spec.name
    return config, mode



def needs_draft(modes: Sequence[str]) -> bool:
    """Whether any of these bench modes runs the draft model ("all" asks for the modes the models given can run,
    so it needs none)."""
    engine_modes = {mode_config(ParseConfig(), m)[1] for m in modes if m not in ("all", DRAFT_ALONE)}
    return DRAFT_ALONE in modes or any(MODE_TABLE[m].needs_draft for m in engine_modes if m in MODE_TABLE)


@dataclasses.dataclass(frozen=True)
class ModeRunner:
    """What `mode_runner` gives: called as a `Runner` it generates; `check(prompts, max_new, seed)` runs every check
    that generation would run on that request (prompts, budget, positions, seed, stop ids, the mode's needs), and
    nothing else: what eval calls on each record before it writes anything. `job(prompts)`: a context in which the
    next `prompts` prompts are one job (`ParseEngine.job`; nothing to declare for a model alone)."""

    run: Runner
    check: Callable[[list, int, int], None]
    job: Callable[[int], contextlib.AbstractContextManager] = lambda prompts: contextlib.nullcontext()

    def __call__(self, prompts: list, max_new: int, seed: int | list[int],
                 max_batch: int | None = None) -> GenerateResult:
        return self.run(prompts, max_new, seed, max_batch)


def mode_runner(target, draft, config: ParseConfig | None, mode: str, temperature: float = 0.0,
                eos_ids: Sequence[int] | None = None, *, honour_rounds: bool = False) -> ModeRunner:
    """A callable that generates with `mode` (a bench mode); `draft` may be None for the modes that need none
    (target, eagle3). `eos_ids`: the stop ids (default: the model's own)."""
    check_modes([mode])
    check_config(config)  # in every mode, the target's included
    temperature = check_float("temperature", temperature, 0.0, error=InputError)
    eos_ids = check_eos_ids(eos_ids, target.config.vocab_size)
    extra = {} if eos_ids is None else {"eos_ids": eos_ids}  # only when given: the engine's default otherwise
    if mode == "target" or mode == DRAFT_ALONE:  # one model alone: no engine (and no draft needed for the target)
        model = target if mode == "target" else draft
        if model is None:
            raise ConfigError(f"mode {DRAFT_ALONE!r} needs a draft model")

        def check_alone(prompts, max_new, seed):
            target_request(model, prompts, max_new, SamplingParams(temperature, seed=seed), eos_ids=eos_ids)

        return ModeRunner(lambda prompts, max_new, seed, max_batch=None: alone(
            model, prompts, max_new, seed, max_batch, temperature=temperature, **extra), check_alone)
    cfg, engine_mode = mode_config(config or ParseConfig(), mode, honour_rounds=honour_rounds)
    if draft is None and MODE_TABLE[engine_mode].needs_draft:
        raise ConfigError(f"mode {mode!r} needs a draft model")
    eng = ParseEngine(target, draft, cfg)
    return ModeRunner(lambda prompts, max_new, seed, max_batch=None: eng.generate(
        prompts, mode=engine_mode, max_new_tokens=max_new, temperature=temperature, seed=seed, max_batch=max_batch,
        **extra), lambda prompts, max_new, seed: eng.request(prompts, engine_mode, max_new, temperature, seed, 0, 1.0,
                                                              eos_ids), eng.job)


def runnable_problems(task, runners: dict, problems: list, settings: RunSettings) -> tuple[Any, list, RunSettings]:
    """(task, problems, settings) with the --data records some runner's check refuses handled before any run (a
    `DataTask.runnable`: refused, or skipped with a warning and `n` lowered to what is left); the embedded task's
    problems as they are."""
    if not hasattr(task, "runnable"):
        return task, problems, settings
    kept = task.runnable([r.check for r in runners.values()], settings)
    if kept is task:
        return task, problems, settings
    settings = dataclasses.replace(settings, n=min(settings.n, len(kept)))
    return kept, kept.problems(settings.n, settings.seed), settings


def alone(model, prompts: list, max_new: int, seed: int, max_batch: int | None, *, temperature: float,
          eos_ids: Sequence[int] | None = None) -> GenerateResult:
    """One model alone: one batch, or continuous batching through `max_batch` slots when there are more prompts."""
    if max_batch is None or len(prompts) <= max_batch:
        return generate(model, prompts, max_new_tokens=max_new, temperature=temperature, seed=seed, eos_ids=eos_ids)
    req = target_request(model, prompts, max_new, SamplingParams(temperature, seed=seed), eos_ids=eos_ids)
    return serve_request(model, req, max_batch=max_batch)


def check_run_settings(n: int | None = None, max_new_tokens: int | None = None, batch_size: int | None = None,
                       repeats: int | None = None, seed: int | None = None) -> None:
    """The shared run settings of bench, sweep, calibrate and eval: integers (never truncated floats) >= 1, and a
    seed in [0, 2**31); an InputError names the first bad one."""
    for name, value in (("n", n), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size),
                        ("repeats", repeats)):
        if value is not None:
            check_int(name, value, 1, error=InputError)
    if seed is not None:
        check_seed("seed", seed, error=InputError)



@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What bench, sweep, calibrate and eval runs share, checked once on construction (an InputError names the
    first bad field): how many problems (`n`; eval runs every record and `measure` every problem it is given),
    at most how many new tokens each, the batch size, the timed repeats, the seed, the sampling temperature, the
    stop ids (None: the models' own), whether to show progress bars, and how prompts are batched: `continuous`
    (each mode takes every prompt in one call, `batch_size` rows at once, a finished row's slot refilled where the
    mode serves; docs/design.md §7) or `fixed` (chunks of `batch_size`, each run as one batch)."""

    n: int = 100
    max_new_tokens: int = 64
    batch_size: int = 16
    repeats: int = 3
    seed: int = 0
    temperature: float = 0.0
    eos_ids: tuple[int, ...] | None = None
    progress: bool = True
    batching: Batching = DEFAULT_BATCHING

    def __post_init__(self) -> None:
        check_choice("batching", self.batching, BATCHING, error=InputError)
        check_run_settings(self.n, self.max_new_tokens, self.batch_size, self.repeats, self.seed)
        object.__setattr__(self, "temperature", check_float("temperature", self.temperature, 0.0, error=InputError))
        eos_ids = check_eos_ids(self.eos_ids)
        object.__setattr__(self, "eos_ids", None if eos_ids is None else tuple(eos_ids))



def recorded_settings(settings: RunSettings, task, split: str | None = None) -> dict:
    """The settings a bench or sweep result records (and its provenance hashes): the run settings, the task and
    its split (default: the task's own, else "test"), and a --data file's path and hash."""
    out = {"n": settings.n, "max_new_tokens": settings.max_new_tokens, "batch_size": settings.batch_size,
           "repeats": settings.repeats, "seed": settings.seed, "task": getattr(task, "name", None),
           "split": split or getattr(task, "split", "test"), "temperature": settings.temperature,
           "eos_ids": None if settings.eos_ids is None else list(settings.eos_ids), "batching": settings.batching}
    if getattr(task, "data", None) is not None:
        out["data"], out["data_sha256"] = task.data, task.data_sha256
    return out



def sampling_text(result: dict) -> str:
    """How a recorded run sampled, for its Markdown: greedy, or at its temperature."""
    t = result.get("temperature") or 0.0
    return "greedy" if t == 0 else f"temperature {t:g}"



def measure(runners: dict[str, Runner], task, problems: Sequence[tuple[str, str]], settings: RunSettings,
            baseline: str = "target") -> dict:
    """Run every runner on the same problems, interleaved (in an order shuffled per repeat and batch, seeded, so that
    no runner always follows the same one; Python's garbage collected before each timed call, so that none pays for
    its predecessor's) and repeated, with
    the max_new_tokens, batch_size, repeats, seed and progress of `settings` (its `n` is the caller's: every
    problem given runs).

    Returns {name: row}; speed-ups are per-repeat tokens/s ratios against `baseline` (which must be a runner). A
    served run's first call sets up every admission size its slots can meet (`runtime/slots.admission_warm_up`)."""
    with admission_warm_up():
        return _measured(runners, task, problems, settings, baseline)


def _measured(runners: dict[str, Runner], task, problems: Sequence[tuple[str, str]], settings: RunSettings,
              baseline: str) -> dict:
    """`measure`'s body."""
    if baseline not in runners:
        raise InputError(f"the baseline {baseline!r} is not among the runs")
    n = len(problems)
    if n < 1:
        raise InputError("no problems to measure on")
    max_new_tokens, batch_size, repeats, seed = (settings.max_new_tokens, settings.batch_size, settings.repeats,
                                                 settings.seed)
    names = list(runners)
    prompts = [p for p, _ in problems]
    if settings.batching == "continuous":  # every prompt in one call per runner, `batch_size` slots kept busy
        chunks, max_batch = [prompts], batch_size
        warm_ups = [prompts]
    else:  # fixed chunks of `batch_size`
        chunks, max_batch = [prompts[i:i + batch_size] for i in range(0, n, batch_size)], None
        warm_ups = [next(c for c in chunks if len(c) == shape) for shape in sorted({len(c) for c in chunks})]
    warm = tqdm(total=len(names) * len(warm_ups), desc="compiling (warm-up runs)", disable=not settings.progress,
                unit="run")
    for name in names:  # warm-up: compile the programs the timed runs use
        for chunk in warm_ups:
            warm.set_postfix_str(f"{name} at batch {min(len(chunk), batch_size)}; {_programs_note()}")
            # again while a call set anything up or explored (at most WARM_UP_CALLS): a schedule="auto" engine
            # measures only batches that set up nothing, explores what it has not measured, and serves what it
            # measured best, so its first calls meet new programs; `setup_events` sees every trace and compile
            # (helper programs and eager operations too, which `compiled_programs` does not count); what still
            # compiles inside the timed calls is counted
            for _ in range(WARM_UP_CALLS):
                before = setup_events()
                res = runners[name](chunk, max_new_tokens, seed, max_batch)
                explored = any(c.get("why") == EXPLORING for c in res.stats.get("schedule", []))
                if setup_events() == before and not explored:
                    break
            warm.update(1)
    warm.set_postfix_str(_programs_note())
    warm.close()
    seconds = {m: np.zeros(repeats) for m in names}
    compiles = {m: 0 for m in names}
    outputs: dict[str, list] = {m: [None] * n for m in names}
    stats_sum: dict[str, dict] = {m: {} for m in names}
    field: dict[str, list[dict]] = {m: [] for m in names}  # each chunk's stats: the field's metrics from their counts
    ran: dict[str, list[dict]] = {m: [{} for _ in range(repeats)] for m in names}  # each repeat's schedule choices
    bar = tqdm(total=repeats * len(chunks) * len(names), desc="bench", disable=not settings.progress)
    for r in range(repeats):
        start = 0
        for ci, chunk in enumerate(chunks):
            for name in interleaved(names, seed, r, ci):
                before = compiled_programs()
                gc.collect()  # uncollected, a parse+eagle3 call's garbage cost the next call 7-9% at batch 64
                t0 = time.perf_counter()
                res = runners[name](chunk, max_new_tokens, seed, max_batch)
                seconds[name][r] += time.perf_counter() - t0
                compiles[name] += compiled_programs() - before  # a compile inside the timing is reported
                _count_choices(ran[name][r], res.stats)
                if r == 0:
                    outputs[name][start: start + len(chunk)] = list(zip(res.texts, res.tokens))
                    _add_stats(stats_sum[name], res.stats, len(chunk))
                    field[name].append(res.stats)
                bar.update(1)
                bar.set_postfix(mode=name, repeat=r)
            start += len(chunk)
    bar.close()
    tps = {m: sum(len(t) for _, t in outputs[m]) / seconds[m] for m in names}
    rows = {}
    for name in names:
        new_tokens = sum(len(t) for _, t in outputs[name])
        correct = [bool(task.grade(p, text)) for p, (text, _) in zip(prompts, outputs[name])]
        speedups = tps[name] / tps[baseline]
        s = stats_sum[name]
        # the draft alone counts its own passes: the target makes none there
        passes, row_passes = ((0, 0) if name == DRAFT_ALONE else (s.get("target_passes", 0), s.get("row_passes", 0)))
        lo, hi = wilson(int(sum(correct)), n)
        rows[name] = {
            "tokens_per_s": float(np.median(tps[name])),
            "tokens_per_s_all": tps[name].tolist(),
            "seconds_median": float(np.median(seconds[name])),
            "seconds_all": seconds[name].tolist(),
            "speedup_vs_target": float(np.median(speedups)),
            "speedup_all": speedups.tolist(),
            "speedup_min": float(np.min(speedups)), "speedup_max": float(np.max(speedups)),
            "accuracy": float(np.mean(correct)),
            "correct": int(sum(correct)),
            "accuracy_ci95": [lo, hi],
            "new_tokens": int(new_tokens),
            "target_passes": int(passes),
            "target_passes_per_100_tokens": 100.0 * row_passes / max(new_tokens, 1),
            "accepted_per_pass": (s["accepted_tokens"] / max(s.get("row_checks", 0), 1)
                                  if "accepted_tokens" in s else None),
            "draft_tokens": int(s.get("draft_tokens", 0)),
            "accepted_tokens": int(s.get("accepted_tokens", 0)),
            "verify_tokens": int(s.get("verify_tokens", 0)),
            "verify_passes": int(s.get("verify_passes", 0)),
            "compiles_in_timing": compiles[name],
            "schedule_ran": ran[name][0],  # the first repeat's, as the stats beside it
            "schedule_ran_each_repeat": ran[name],
            **field_metrics(field[name]),
        }
    return rows


def interleaved(names: list[str], seed: int, repeat: int, chunk: int) -> list[str]:
    """The order the runners take on one chunk of one repeat: a seeded shuffle (a rotation kept every runner behind
    the same one, so whatever a run leaves to the next fell on one runner only)."""
    order = np.random.default_rng([seed, repeat, chunk]).permutation(len(names))
    return [names[i] for i in order]


def _add_stats(acc: dict, stats: dict, rows: int) -> None:
    """A call's counts added into `acc` (its numbers)."""
    for key, value in stats.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            acc[key] = acc.get(key, 0) + value
    # passes are batched: per request, each pass counts once per row it carried (the result's own count where it
    # has one: a served or merged result holds many batches)
    acc["row_passes"] = acc.get("row_passes", 0) + stats.get("request_passes", stats.get("target_passes", 0) * rows)
    checks = stats.get("verify_passes", stats.get("target_passes", 0))
    acc["row_checks"] = acc.get("row_checks", 0) + stats.get("request_checks", checks * rows)


def ran_in_repeats(row: dict) -> dict[str, int]:
    """A mode's schedule decisions summed over its timed repeats (the first repeat's where a result predates the
    per-repeat record)."""
    total: dict[str, int] = {}
    for repeat in row.get("schedule_ran_each_repeat") or [row.get("schedule_ran") or {}]:
        for name, count in repeat.items():
            total[name] = total.get(name, 0) + count
    return dict(sorted(total.items()))


def ran_text(row: dict) -> str:
    """`ran_in_repeats` as report text ("parse-single x14, target x1"; empty where nothing was scheduled)."""
    return ", ".join(f"{name} x{count}" for name, count in ran_in_repeats(row).items())


def decision_name(decision: dict) -> str:
    """The choice a schedule decision ran, as reports name it ("parse-single"; "target": plain decoding)."""
    return option(decision["ran"], decision.get("rounds"))


def _count_choices(ran: dict, stats: dict) -> None:
    """A call's schedule decisions counted into `ran`, per choice ("parse-single": the rounds the schedule chose)."""
    for choice in stats.get("schedule", []):
        name = decision_name(choice)
        ran[name] = ran.get(name, 0) + 1


def ran_per_prompt(stats: dict, n: int) -> list[str] | None:
    """What `schedule="auto"` ran for each of a call's `n` prompts, from its decisions in prompt order (each says how
    many prompts it ran); None where nothing was scheduled."""
    decisions = stats.get("schedule")
    if not decisions:
        return None
    names = [decision_name(d) for d in decisions for _ in range(int(d.get("rows") or 0))]
    return names if len(names) == n else None


def field_metrics(parts: list[dict]) -> dict:
    """The field's speculation metrics of a mode (parse_jax/runtime/metrics.py), from every chunk's raw counts;
    empty for a mode that reports none (target)."""
    out = combine(parts)
    out.pop("accepted_tokens", None)  # the row has its own
    return out



def _programs_note() -> str:
    """How many generation programs this process holds so far; with the compile cache on, how many XLA executables
    (those programs and the small ones around them) were loaded from it and how many compiled."""
    cache = compile_cache.stats()
    note = f"{compiled_programs()} programs"
    if cache["dir"] is not None:
        note += f"; executables: {cache['hits']} loaded from the compile cache, {cache['misses']} compiled"
    exe = executables.stats()
    if exe["dir"] is not None:
        note += f"; programs: {exe['loads']} loaded from the executable cache, {exe['compiles']} compiled for it"
    return note



def format_row(name: str, r: dict) -> str:
    acc_pass = "-" if r["accepted_per_pass"] is None else f"{r['accepted_per_pass']:.2f}"
    ci = r.get("accuracy_ci95")
    ci_text = f" ({100 * ci[0]:.1f}-{100 * ci[1]:.1f})" if ci else ""
    return (f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_target']:.2f}x "
            f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | {100 * r['accuracy']:.1f}%{ci_text} | {acc_pass} | "
            f"{r['target_passes_per_100_tokens']:.1f} |")



def write_text(path: str | Path, text: str) -> Path:
    """Write whole or not at all (parse_jax.utils.atomic): an interrupted write leaves the previous file as it was."""
    return atomic.write_text(path, text)



def write_json(result: dict, path: str | Path) -> Path:
    return atomic.write_json(path, result)
