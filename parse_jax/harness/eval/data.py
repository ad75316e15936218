"""Eval records from a JSONL file, validated line by line, each keyed by its line number and content hash.

Two record formats (one JSON object per line; extra fields are kept and ignored):

  GSM8K:          {"question": "...", "answer": "... #### 42"}     graded by the number after "####"
  embedded task:  {"prompt": "( 3 + 4 ) * ( 5 - 2 ) :", "solution": "3 + 4 = 7 ; ... ; answer 1"}
                  graded by the task's own grader; "solution" (the reference, as `task.problems` gives it)
                  is optional, the task computes the answer from the prompt.

`python -m parse_jax.harness.eval.data --n 100 --out problems.jsonl [--split test] [--seed 0]` writes embedded-task
records.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

from parse_jax.errors import InputError
from parse_jax.harness.eval.extract import format_number, reference_answer
from parse_jax.utils.validation import shorten

KINDS = ("gsm8k", "task")
ON_BAD_LINE = ("error", "skip")


@dataclasses.dataclass(frozen=True)
class Record:
    line: int        # 1-based line number in the data file
    key: str         # "LINE:HASH": what the results file remembers, so a record is never counted twice
    kind: str        # "gsm8k" or "task"
    prompt: str      # the question (gsm8k) or the task prompt
    reference: str   # the reference final answer, as text


@dataclasses.dataclass(frozen=True)
class BadLine:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def line_key(number: int, text: str) -> str:
    return f"{number}:{hashlib.sha256(text.encode('utf-8')).hexdigest()[:16]}"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_record(number: int, text: str, task=None) -> Record:
    """One line -> Record; InputError naming what is wrong (the caller adds the line number)."""
    if not text.strip():
        raise InputError("empty line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}")
    key = line_key(number, text.strip())
    if "question" in obj:
        q, a = obj.get("question"), obj.get("answer")
        if not isinstance(q, str) or not q.strip():
            raise InputError("'question' must be a non-empty string")
        if not isinstance(a, str):
            raise InputError("a GSM8K record needs an 'answer' string ending in '#### N'")
        ref = reference_answer(a)
        if ref is None:
            raise InputError("'answer' has no final answer '#### N'")
        return Record(number, key, "gsm8k", q, format_number(ref))
    if "prompt" in obj:
        p = obj["prompt"]
        if not isinstance(p, str) or not p.strip():
            raise InputError("'prompt' must be a non-empty string")
        if task is None:
            raise InputError("a task record needs the embedded task to grade it")
        try:
            ref = task.answer(p)
        except InputError as e:
            raise InputError(f"'prompt' is not a problem of task {getattr(task, 'name', '?')!r}: {e}") from None
        return Record(number, key, "task", p, ref)
    raise InputError(f"unknown record format (fields {sorted(obj)}): need 'question' + 'answer' (GSM8K) "
                     "or 'prompt' (embedded task)")


def load_records(path: str | Path, task=None, on_bad_line: str = "error",
                 limit: int | None = None) -> tuple[list[Record], list[BadLine]]:
    """Every valid record of a JSONL file, and the bad lines; `on_bad_line="error"` raises on any bad line
    (all of them listed, with their line numbers), "skip" returns them for the caller to report. `limit`: only the
    first `limit` records (lm-eval's --limit): the lines after the one that holds the last are not read."""
    if on_bad_line not in ON_BAD_LINE:
        raise InputError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read data file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"data file {path} is not UTF-8 text (byte {e.start})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    records, bad = [], []
    for number, line in enumerate(lines, start=1):
        if limit is not None and len(records) >= limit:
            break
        try:
            records.append(parse_record(number, line.rstrip("\r"), task))
        except InputError as e:
            bad.append(BadLine(number, shorten(str(e), 300)))  # a 20 MB line is never echoed whole
    if bad and on_bad_line == "error":
        shown = "; ".join(str(b) for b in bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise InputError(f"{path}: {len(bad)} bad line(s): {shown} (--on-bad-line skip to skip them)")
    if not records:
        raise InputError(f"{path} holds no valid record")
    return records, bad


def write_task_jsonl(task, n: int, path: str | Path, seed: int = 0, split: str = "test") -> Path:
    """`n` problems of the embedded task as JSONL records {"prompt", "solution"}."""
    path = Path(path)
    lines = [json.dumps({"prompt": p, "solution": s}) for p, s in task.problems(n, seed, split=split)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def main() -> None:
    from parse_jax.tasks import load_task

    ap = argparse.ArgumentParser(description="write embedded-task problems as eval JSONL records")
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--task", default="default")
    ap.add_argument("--split", default="test", choices=["test", "train", "all"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"wrote {write_task_jsonl(load_task(a.task), a.n, a.out, a.seed, a.split)}")


if __name__ == "__main__":
    main()
