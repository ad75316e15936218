"""The resumable eval loop: generate in batches, grade, append each record's result to a JSONL file as it finishes.

The results file starts with a header line (data file hash, mode, config, models, sampling) and then holds one
line per finished record, keyed by the record's line number and content hash. Re-running the same command reads
the file, skips every record already there and appends the rest: an interrupted run resumes where it stopped and
never counts a record twice. A header that does not match the new run (another data file, mode or setting) is an
error, not a silent mix; a torn last line (a write cut by a kill) is dropped and that record runs again.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from parse_jax.errors import ConfigError, InputError
from parse_jax.harness.eval.data import ON_BAD_LINE, BadLine, Record
from parse_jax.harness.eval.extract import (
    DEFAULT_INSTRUCTION,
    extract_answer,
    flexible_answer,
    format_number,
    strict_answer,
)
from parse_jax.harness.eval.report import format_summary, summarize
from parse_jax.harness.runs import RunSettings, ran_per_prompt
from parse_jax.runtime.requests import GenerateResult
from parse_jax.utils.atomic import check_file_writable, write_text
from parse_jax.utils.validation import SEED_MAX, check_choice, check_int, shorten

RESULTS_VERSION = 1
CHAT = ("auto", "on", "off")
PLAIN_FORMAT = "Question: {question}\nAnswer:"
EVAL_SETTINGS = RunSettings(batch_size=8)  # run_eval's defaults (it reads batch_size and progress)


def summary_path(out: str | Path) -> Path:
    """results.jsonl -> results.summary.json (next to it)."""
    out = Path(out)
    return out.with_name((out.stem if out.suffix == ".jsonl" else out.name) + ".summary.json")


def make_header(data_path: str | Path, data_sha256: str, settings: dict) -> dict:
    return {"type": "header", "version": RESULTS_VERSION, "data": str(data_path), "data_sha256": data_sha256,
            "settings": json.loads(json.dumps(settings, default=str))}


class ResultsFile:
    """The append-only results JSONL of one eval run (header + one line per finished record)."""

    def __init__(self, path: Path | None, header: dict, results: list[dict]) -> None:
        self.path, self.header, self.results = path, header, results
        self.done = {r["key"] for r in results}

    @classmethod
    def in_memory(cls, header: dict | None = None) -> ResultsFile:
        """Results kept in memory only (`pj.evaluate` from a training loop): the same loop, no file."""
        return cls(None, header or {}, [])

    @classmethod
    def check(cls, path: str | Path, header: dict) -> None:
        """Everything `open` checks (a folder, an unwritable place, another run's file), without writing: what
        `parse-jax eval` calls before the models load, so that a bad start leaves no file behind."""
        path = Path(path)
        if path.is_dir():
            raise InputError(f"--out {path} is a folder; give a file name such as {path / 'results.jsonl'}")
        try:
            check_file_writable(path)
        except InputError as e:
            raise InputError(f"cannot write results file {path}: {str(e).partition(': ')[2]}") from None
        if path.exists() and path.stat().st_size > 0:
            cls._read(path, header)

    @classmethod
    def _read(cls, path: Path, header: dict) -> tuple[dict, list[dict], int, int]:
        """(header, results, bytes of complete lines, file size) of an existing results file checked against
        `header`."""
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read results file {path}: {e.strerror or e}") from None
        lines = raw.split(b"\n")
        complete = lines[:-1]  # whatever follows the last newline is a torn write
        good_bytes = sum(len(x) + 1 for x in complete)
        parsed = []
        for i, line in enumerate(complete, start=1):
            try:
                parsed.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                if i == len(complete):  # a torn last line (a kill between write and newline is impossible, but
                    good_bytes -= len(line) + 1  # a partial flush of a long line is not)
                    break
                raise InputError(f"results file {path} is corrupt at line {i}; move it away to start over") from None
        if not parsed or not isinstance(parsed[0], dict) or parsed[0].get("type") != "header":
            raise InputError(f"{path} exists and is not a parse-jax eval results file; choose another --out")
        results = [r for r in parsed[1:] if isinstance(r, dict) and r.get("type") == "result"]
        if results:  # a file of a run that wrote no record holds nothing to resume: a new run starts it over
            _check_header(path, parsed[0], header)
        return parsed[0], results, good_bytes, len(raw)

    @classmethod
    def open(cls, path: str | Path, header: dict) -> ResultsFile:
        """Start `path` with `header` (written whole: a temporary file renamed into place), or check an existing
        one against it and read its finished records. A file holding a header and no record (a run stopped before
        its first record) is started over with `header`, whatever its settings were."""
        path = Path(path)
        cls.check(path, header)
        if path.exists() and path.stat().st_size > 0:
            old, results, good_bytes, size = cls._read(path, header)
        if not path.exists() or path.stat().st_size == 0 or not results:
            write_text(path, json.dumps(header) + "\n")
            return cls(path, header, [])
        try:
            with open(path, "r+b") as f:  # writable? fail now, not after the first batch
                if good_bytes < size:
                    f.truncate(good_bytes)
        except OSError as e:
            raise InputError(f"cannot write results file {path}: {e.strerror or e}") from None
        return cls(path, old, results)

    def append(self, rows: Sequence[dict]) -> None:
        """Append finished records and push them to disk before anything else happens."""
        new = [r for r in rows if r["key"] not in self.done]
        if self.path is None:
            self.results += new
            self.done |= {r["key"] for r in new}
            return
        try:
            with open(self.path, "a") as f:
                for r in new:
                    f.write(json.dumps(r) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise InputError(f"cannot append to results file {self.path}: {e.strerror or e}") from None
        self.results += new
        self.done |= {r["key"] for r in new}


# settings keys of later versions: an older results file without them resumes
ADDED_KEYS = ("models_saved",)
# a sampled run's header: its records draw from their own seeds, whatever their batch (a sampled file of an earlier
# version, whose draws depended on the batch, lacks it and is not resumed)
PER_RECORD_DRAWS = "per-record"


def _check_header(path: Path, old: dict, new: dict) -> None:
    where = f"{path} was started"
    if old.get("version") != new["version"]:
        raise ConfigError(f"{where} by another results format (version {old.get('version')}); choose a new --out")
    if old.get("data_sha256") != new["data_sha256"]:
        raise ConfigError(f"{where} on a different data file ({old.get('data')}, sha256 "
                          f"{str(old.get('data_sha256'))[:12]}; now {new['data']}, {new['data_sha256'][:12]}): "
                          "the data changed; choose a new --out or delete the old results")
    a, b = old.get("settings", {}), new["settings"]
    # a key later versions add is compared only where the old header has it (its file resumes as before)
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and (k in a or k not in ADDED_KEYS))
    if "draws" in diff and "draws" not in a and (a.get("temperature") or 0) > 0:
        raise ConfigError(f"{where} by an earlier version whose sampled draws depended on each record's batch: the "
                          "records left would draw by another scheme; choose a new --out or delete the old results")
    if diff == ["models_saved"]:
        then, now = a.get("models_saved") or {}, b.get("models_saved") or {}
        which = " and ".join(k for k in sorted({*then, *now}) if then.get(k) != now.get(k))
        raise ConfigError(f"{where} on other weights: the {which} step was saved again since (a run started over "
                          "reuses its step numbers); choose a new --out or delete the old results")
    if diff:
        shown = "; ".join(f"{k}: {a.get(k)!r} then, {b.get(k)!r} now" for k in diff)
        raise ConfigError(f"{where} with other settings ({shown}); resume with the same ones or choose a new --out")


def build_prompt(record: Record, tokenizer, chat: str = "auto", instruction: str = DEFAULT_INSTRUCTION,
                 template_kwargs: dict | None = None):
    """The model input of a record: task prompts as they are (text, which the engine encodes as `tokenizer(text)`
    does); GSM8K questions through the model's chat template when it has one (token ids; the template writes its
    own BOS), else "Question: ...\\nAnswer:" text."""
    if chat not in CHAT:
        raise InputError(f"chat must be one of {CHAT}, got {chat!r}")
    if record.kind == "task":
        return record.prompt
    template = getattr(tokenizer, "chat_template", None)
    if chat == "on" and template is None:
        raise ConfigError("--chat on, but the model's tokenizer has no chat template")
    if chat == "off" or template is None:
        return PLAIN_FORMAT.format(question=record.prompt)
    content = f"{record.prompt}\n{instruction}" if instruction else record.prompt
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                          **(template_kwargs or {})))


def lm_eval_scores(record: Record, text: str) -> dict:
    """A GSM8K record's two lm-eval scorings side by side: strict-match (`#### N`) and flexible-extract (the last
    number), each with the answer it read; empty for embedded-task records."""
    if record.kind == "task":
        return {}
    strict, flexible = format_number(strict_answer(text)), format_number(flexible_answer(text))
    return {"correct_strict": strict is not None and strict == record.reference, "extracted_strict": strict,
            "correct_flexible": flexible is not None and flexible == record.reference,
            "extracted_flexible": flexible}


# per-request speculation counts of a result (GenerationStats' lists) -> the record's `stats` keys
REQUEST_STATS = {"accepted_per_request": "accepted_tokens", "prefixes_per_request": "steps_drafted",
                 "drafts_per_request": "num_drafts"}


def record_stats(stats: dict, j: int) -> dict:
    """The speculation stats of request `j` of a call's result: its own counts, and its verification passes (the
    passes it was live in, where the result says; else the call's, a batched pass counting once for each row)."""
    out = {name: int(stats[key][j]) for key, name in REQUEST_STATS.items() if stats.get(key) is not None}
    if "accepted_tokens" in out:
        checks = stats.get("verify_passes", stats.get("target_passes"))
        if stats.get("checks_per_request") is not None:  # its own: a call may hold many batches or slot refills
            checks = stats["checks_per_request"][j]
        elif stats.get("drafts_per_request") is not None:
            checks = stats["drafts_per_request"][j]
        if checks is not None:
            out["verify_passes"] = int(checks)
    return out


def prompt_text(prompt, tokenizer) -> str:
    """A model input as text: a text prompt as it is, a chat-rendered one decoded with its special tokens."""
    if isinstance(prompt, str) or tokenizer is None:
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return tokenizer.decode(prompt, keep_special=True)


def grade(record: Record, text: str, task=None) -> tuple[bool, str | None]:
    """(correct, extracted answer) of one output."""
    if record.kind == "task":
        answer = task.final_answer(text)
        return bool(task.grade(record.prompt, text)), answer
    value = extract_answer(text)
    shown = format_number(value)
    return shown is not None and shown == record.reference, shown


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How `build_prompt` turns a record into a model input: `chat` (auto, on, off) for the chat template, the
    instruction after a GSM8K question, and keywords for the chat template (e.g. enable_thinking=False)."""

    chat: str = "auto"
    instruction: str = DEFAULT_INSTRUCTION
    template_kwargs: dict | None = None

    def build(self, record: Record, tokenizer):
        return build_prompt(record, tokenizer, self.chat, self.instruction, self.template_kwargs)


GROUP_BATCHES = 8  # records per generate call under continuous batching, in batches (the resume granularity)


def batch_seed(seed: int, line: int) -> int:
    """The seed of the record at `line` of the data file: `seed + line`, wrapped into the one seed range
    (0..2**31 - 1), so that every seed the flags take gives record seeds generation takes. A record draws from its
    own seed alone (generation keys each prompt by its own), so a resumed run draws what a whole one would."""
    return (seed + line) % (SEED_MAX + 1)


def check_records(records: Sequence[Record], check: Callable[[list, int, int], None], settings: RunSettings,
                  *, tokenizer=None, prompt_format: PromptFormat = PromptFormat(), on_bad_line: str = "error",
                  where: str = "data") -> tuple[list[Record], list[BadLine]]:
    """(records that can be served, the bad ones) before anything runs or is written: each record's model input
    goes through `check(prompts, max_new, seed)` (`ModeRunner.check`: its length against the models' positions,
    its tokens, its seed). `on_bad_line="error"` refuses a bad record (named by its line, the record cut), "skip"
    returns it for the caller to report. Errors of the settings themselves (not of one record) propagate."""
    check_choice("on_bad_line", on_bad_line, ON_BAD_LINE, error=InputError)
    good, bad = [], []
    for r in records:
        refused = refusal(check, prompt_format.build(r, tokenizer), r.line, settings.max_new_tokens,
                          batch_seed(settings.seed, r.line))
        (bad if refused else good).append(refused or r)
    if bad and on_bad_line == "error":
        refuse_records(where, bad)
    if not good:
        raise InputError(f"{where}: no record can be run: {bad[0]}")
    return good, bad


def refusal(check: Callable[[list, int, int], None], prompt, line: int, max_new: int, seed: int) -> BadLine | None:
    """Why `check` (a `ModeRunner.check`) refuses the record of `line` with this model input, or None."""
    try:
        check([prompt], max_new, seed)
    except InputError as e:
        return BadLine(line, shorten(re.sub(r"^prompt 0\b", "the record", str(e)), 300))
    return None


def refuse_records(where: str, bad: Sequence[BadLine]) -> None:
    """The one error for records that cannot run: how many, the first five by line, and how to skip them."""
    shown = "; ".join(str(b) for b in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise InputError(f"{where}: {len(bad)} record(s) cannot be run: {shown} (--on-bad-line skip to skip them)")


def run_eval(records: Sequence[Record], generate: Callable[[list, int], GenerateResult], results: ResultsFile,
             settings: RunSettings = EVAL_SETTINGS, *, tokenizer=None, task=None,
             prompt_format: PromptFormat = PromptFormat(), log: Callable[[str], None] = print) -> dict:
    """Evaluate the records not yet in `results`, `settings.batch_size` rows at a time (a bar when
    `settings.progress`); returns the summary over `records`. With continuous batching (the default) each call
    takes `GROUP_BATCHES` batches of records and keeps `batch_size` rows in flight; results are appended per call.

    `generate(prompts, lines)` runs one call (texts + tokens + stats) of at most `batch_size` rows at once, the
    records of `lines` each drawing from its own seed.
    The summary covers `records` only: a file that holds more (an earlier run without `--limit`) keeps them, and a
    later run over them reports them again."""
    batch_size, progress = settings.batch_size, settings.progress
    # continuous batching: a call takes GROUP_BATCHES batches' worth of records, `batch_size` rows in flight
    step = batch_size * (GROUP_BATCHES if settings.batching == "continuous" else 1)
    todo = [r for r in records if r.key not in results.done]
    done = len(records) - len(todo)
    if done:  # each record draws from its own seed: the records left draw what a whole run would give them
        log(f"resuming {results.path}: {done} of {len(records)} records already done")
    bar = tqdm(total=len(records), initial=done, desc="eval", disable=not progress)
    correct = sum(bool(r["correct"]) for r in rows_of(results, records))
    for i in range(0, len(todo), step):
        batch = todo[i: i + step]
        prompts = [prompt_format.build(r, tokenizer) for r in batch]
        t0 = time.perf_counter()
        res = generate(prompts, [r.line for r in batch])
        seconds = time.perf_counter() - t0
        ran = ran_per_prompt(res.stats, len(batch))
        rows = []
        for j, r in enumerate(batch):
            right, extracted = grade(r, res.texts[j], task)
            row = {"type": "result", "key": r.key, "line": r.line, "kind": r.kind, "correct": right,
                   "extracted": extracted, **lm_eval_scores(r, res.texts[j]), "reference": r.reference,
                   "new_tokens": len(res.tokens[j]), "seconds": seconds / len(batch),
                   "prompt": prompt_text(prompts[j], tokenizer), "output": res.texts[j]}
            if ran is not None:
                row["ran"] = ran[j]
            stats = record_stats(res.stats, j)
            if stats:
                row["stats"] = stats
                if "accepted_tokens" in stats:  # the flat keys of earlier versions (summaries read them)
                    row["accepted_tokens"] = stats["accepted_tokens"]
                    if "verify_passes" in stats:
                        row["verify_passes"] = stats["verify_passes"]
            rows.append(row)
        results.append(rows)
        done, correct = done + len(batch), correct + sum(r["correct"] for r in rows)
        bar.update(len(batch))
        bar.set_postfix(acc=f"{100 * correct / done:.1f}%")
    bar.close()
    summary = summarize(rows_of(results, records))
    log(format_summary(summary))
    return summary


def rows_of(results: ResultsFile, records: Sequence[Record]) -> list[dict]:
    """The result rows of `records` (in the file's order): what a run over them reports."""
    keys = {r.key for r in records}
    return [row for row in results.results if row["key"] in keys]


def write_summary(results: ResultsFile, summary: dict, provenance: dict, bad_lines: Sequence = ()) -> Path:
    """results.summary.json: the totals of the run's records (`summary`), the header's settings, provenance."""
    from parse_jax.harness.runs import write_json

    doc = {**summary, "results": str(results.path), "data": results.header["data"],
           "data_sha256": results.header["data_sha256"], "settings": results.header["settings"],
           "bad_lines": [{"line": b.line, "reason": b.reason} for b in bad_lines], "provenance": provenance}
    return write_json(doc, summary_path(results.path))


class DataTask:
    """The records of a JSONL file (`--data` of bench, sweep and calibrate) as a task: `problems` gives the first n
    records' model inputs (as eval builds them: chat template or plain text; file order, the seed plays no part),
    `grade` grades an output exactly as eval does, so accuracy means eval's accuracy."""

    split = "data"

    def __init__(self, path: str | Path, records: Sequence[Record], tokenizer, task=None, chat: str = "auto",
                 instruction: str = DEFAULT_INSTRUCTION, template_kwargs: dict | None = None, *,
                 on_bad_line: str = "error") -> None:
        from parse_jax.harness.eval.data import file_sha256

        check_choice("on_bad_line", on_bad_line, ON_BAD_LINE, error=InputError)
        self.on_bad_line = on_bad_line
        self.data, self.data_sha256 = str(path), file_sha256(path)
        self.name = f"data:{Path(path).name}"
        self.records, self.task = list(records), task
        self.inputs = [build_prompt(r, tokenizer, chat, instruction, template_kwargs) for r in self.records]
        self._by_input = {_hashable(x): r for x, r in zip(self.inputs, self.records)}

    def __len__(self) -> int:
        return len(self.records)

    def runnable(self, checks: Sequence[Callable[[list, int, int], None]], settings: RunSettings) -> DataTask:
        """This task with the records a run of `settings.n` would take, each passed by every mode's check
        (`ModeRunner.check`: the record against the models' positions, its tokens) before anything runs, as eval
        checks them: `on_bad_line="error"` refuses the first n's bad ones, naming their lines; "skip" names them
        in a warning and takes the next records, up to n that run."""
        from parse_jax.utils.progress import logger

        bad, keep = [], []
        for i, (r, x) in enumerate(zip(self.records, self.inputs)):
            if len(keep) == settings.n or (self.on_bad_line == "error" and i >= settings.n):
                break
            for check in checks:
                refused = refusal(check, x, r.line, settings.max_new_tokens, settings.seed)
                if refused:
                    bad.append(refused)
                    break
            else:
                keep.append(i)
        if not bad:
            return self
        if self.on_bad_line == "error":
            refuse_records(self.data, bad)
        if not keep:
            raise InputError(f"{self.data}: no record can be run: {bad[0]}")
        for b in bad:
            logger.warning(f"skipping {b}")
        kept = copy.copy(self)
        kept.records = [self.records[i] for i in keep]
        kept.inputs = [self.inputs[i] for i in keep]
        return kept

    def problems(self, n: int, seed: int = 0, split: str = "data") -> list[tuple]:
        check_int("n", n, 1, error=InputError)
        if n > len(self.records):
            raise InputError(f"n={n}, but {self.data} holds {len(self.records)} records; give --n "
                             f"{len(self.records)} or fewer")
        return [(x, r.reference) for x, r in zip(self.inputs[:n], self.records[:n])]

    def grade(self, prompt, text: str) -> bool:
        return grade(self._by_input[_hashable(prompt)], text, self.task)[0]


def _hashable(prompt):
    return prompt if isinstance(prompt, str) else tuple(int(t) for t in prompt)
