"""`pj.evaluate`: accuracy and speed of a mode (PARSE by default) on eval records, in this process.

It is the one code path of `parse-jax eval` (the CLI only adds the resumable results file and the summary file),
and it is meant to be called from a training loop every N steps with the params fresh from the optimizer:

    pj.evaluate(target.with_params(params), draft, records)

Nothing is reloaded, and while the shapes stay the same nothing is compiled again: every jitted program of the
engine takes the params as an argument and is cached by (config, shape buckets), never by the params' values.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from parse_jax.errors import InputError
from parse_jax.harness.eval.data import Record, load_records, parse_record
from parse_jax.harness.eval.results import (
    DEFAULT_INSTRUCTION,
    PromptFormat,
    ResultsFile,
    batch_seed,
    check_records,
    rows_of,
    run_eval,
)
from parse_jax.settings import DEFAULT_BATCHING
from parse_jax.utils.validation import check_int, shorten


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What one evaluation gives; `records` has one result per record (key, line, correct, extracted, reference,
    output, new_tokens, seconds, and accepted_tokens / verify_passes in the speculative modes)."""

    accuracy: float | None
    accuracy_ci95: tuple[float, float]   # 95% Wilson interval
    n: int
    correct: int
    tokens_per_s: float | None           # new tokens over the wall time of the generate calls (host work included)
    accepted_per_pass: float | None      # accepted draft tokens per request per verification (bench's figure)
    new_tokens: int
    seconds: float
    records: list[dict]
    summary: dict                        # the totals as results.summary.json holds them


def as_records(records: str | Path | Sequence[Any], task: Any = None, limit: int | None = None) -> list[Record]:
    """Eval records from a JSONL path, `Record`s, JSON-like dicts ({"prompt": ...} or {"question", "answer"}), or
    the embedded task's (prompt, solution) pairs (`task.problems(n, seed)`); a bad one is an InputError. `limit`:
    the first `limit` only (what lies past them is not read)."""
    if limit is not None:
        limit = check_int("limit", limit, 1, error=InputError)
    if isinstance(records, (str, Path)):
        return load_records(records, task, limit=limit)[0]
    if not isinstance(records, Sequence):
        raise InputError(f"records must be a JSONL path or a list of records, got {type(records).__name__}")
    records = records if limit is None else records[:limit]
    out = []
    for i, r in enumerate(records, start=1):
        if isinstance(r, Record):
            out.append(r)
            continue
        if isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, str) for x in r):
            r = {"prompt": r[0], "solution": r[1]}
        if not isinstance(r, dict):
            raise InputError(f"record {i}: expected a Record, a dict or a (prompt, solution) pair, got "
                             f"{type(r).__name__}")
        try:
            out.append(parse_record(i, json.dumps(r), task))
        except InputError as e:
            raise InputError(f"record {i}: {shorten(str(e), 300)}") from None
    if not out:
        raise InputError("no records to evaluate")
    return out


def evaluate(target: Any, draft: Any, records: str | Path | Sequence[Any], mode: str = "parse",
             config: Any = None, batch_size: int = 8, *, max_new_tokens: int = 256, temperature: float = 0.0,
             seed: int = 0, task: Any = None, chat: str = "auto", instruction: str = DEFAULT_INSTRUCTION,
             results: ResultsFile | None = None, progress: bool = False,
             log: Callable[[str], None] | None = None, eos_ids: Sequence[int] | None = None,
             template_kwargs: dict | None = None, limit: int | None = None,
             batching: str = DEFAULT_BATCHING) -> EvalResult:
    """Generate with `mode` (a bench mode: target, sd, sequential, parse, parse-multi, eagle3, parse+eagle3, draft)
    on every record, grade, and total. `draft` may be None for mode "target"; `config`: a `ParseConfig`.

    `results`: a `ResultsFile` to append to and resume from (what `parse-jax eval --out` uses); default: in
    memory. A record's seed is `seed + its line` modulo 2**31 (`batch_seed`), its draws its own whatever call or
    batch it runs in, so a resumed run draws what a whole one would. `eos_ids`: the stop ids (default: the models'
    own); `template_kwargs`: for the chat template (e.g. enable_thinking=False). Every setting, and every record
    (its length against the models' positions, its seed), is checked before the first record runs: a record that
    cannot run is an InputError naming its line. `limit`: only the first `limit` records (lm-eval's --limit).
    `batching`: continuous (each call takes 8 batches of records, `batch_size` rows in flight) or fixed (one batch
    per call)."""
    from parse_jax.harness.runs import RunSettings, mode_runner
    from parse_jax.tasks import load_task

    settings = RunSettings(max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, temperature=temperature,
                           eos_ids=eos_ids, progress=progress, batching=batching)
    task = task if task is not None else load_task()
    records = as_records(records, task, limit)
    runner = mode_runner(target, draft, config, mode, temperature=settings.temperature, eos_ids=settings.eos_ids,
                         honour_rounds=True)
    prompt_format = PromptFormat(chat, instruction, template_kwargs)
    records, _ = check_records(records, runner.check, settings, tokenizer=target.tokenizer,
                               prompt_format=prompt_format)
    return evaluate_checked(runner, records, settings, tokenizer=target.tokenizer, task=task,
                            prompt_format=prompt_format, results=results, log=log)


def evaluate_checked(runner: Any, records: Sequence[Record], settings: Any, *, tokenizer: Any, task: Any,
                     prompt_format: PromptFormat, results: ResultsFile | None = None,
                     log: Callable[[str], None] | None = None) -> EvalResult:
    """`evaluate` past its checks: `records` (each checked against `runner`, a `mode_runner`) run with `runner`
    and graded. `parse-jax eval` calls it with the runner its own checks used (one engine per run)."""
    results = results if results is not None else ResultsFile.in_memory()

    def generate(prompts: list, lines: list[int]):
        seeds = [batch_seed(settings.seed, line) for line in lines]  # each record its own: any call, any batch
        return runner(prompts, settings.max_new_tokens, seeds, settings.batch_size)

    with runner.job(max(sum(r.key not in results.done for r in records), 1)):  # setup is charged to this eval
        summary = run_eval(records, generate, results, settings, tokenizer=tokenizer, task=task,
                           prompt_format=prompt_format, log=log or (lambda _: None))
    return EvalResult(accuracy=summary["accuracy"], accuracy_ci95=tuple(summary["accuracy_ci95"]), n=summary["n"],
                      correct=summary["correct"], tokens_per_s=summary["tokens_per_s"],
                      accepted_per_pass=summary["accepted_per_pass"], new_tokens=summary["new_tokens"],
                      seconds=summary["seconds"], records=rows_of(results, records), summary=summary)
