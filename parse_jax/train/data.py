"""Training batches with static shapes, in the layout the target verifies with (docs/design.md §2).

Every row is one solution (clean, synthetically corrupted, or a real draft output) written once, followed by a
copy of the verification suffix for every step boundary and for the final answer: ``BOS prompt s1 ; s2 ; ...
answer v EOS | check | check ...``. Copy k sees only the prompt and the solution up to boundary k and sits at the
RoPE positions that follow it, so its last token predicts the judge word for exactly the text of
``task.verify_prompt(prompt, steps[:k])``: the same tokens, positions and visibility as a standalone verification
prompt or a PARSE pass. One row therefore carries a label for every prefix of its solution (clean prefixes before
a wrong step, erroneous ones from it on), which is what lets the judge learn: a row with one verification prompt
per row gave one label per 40 tokens, and the judge stayed at chance (EXPERIMENTS.md).

Losses: language modelling on the solution tokens up to the first wrong step (all of it, and EOS, for a correct
solution); the judge word at the last token of every suffix copy. A batch is a dict of numpy arrays of shape
[B, L]: ``tokens``, ``targets`` (what each position predicts), ``positions``, ``limit`` and ``group`` (the mask
metadata of `pallas_kernels.reference.visibility`), float32 ``lm_mask`` and ``judge_mask``. Batch `step` depends
only on (seed, step), so the data RNG state of a run is its step counter and a resumed run sees exactly the
batches an uninterrupted one sees.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.tasks import Task
from parse_jax.utils.validation import check_boundaries

PAD_ID = 0


def packed_row(seq: Sequence[int], ends: Sequence[int], suffix: Sequence[int]) -> dict[str, np.ndarray]:
    """`seq` then one copy of `suffix` per prefix end, with the positions and mask metadata of docs/design.md §2
    (copy k, token j: position b_k + j, sees seq[:b_k] and copy-k tokens <= j). Built in numpy on the host: rows
    are made one at a time, of every length, where a device program (`verify.block.pack_block`) would compile
    per shape."""
    d, s = len(seq), len(suffix)
    bounds = np.asarray(check_boundaries(ends, d), np.int32)
    j = np.tile(np.arange(s, dtype=np.int32), len(ends))
    return {"tokens": np.concatenate([np.asarray(seq, np.int32), np.tile(np.asarray(suffix, np.int32), len(ends))]),
            "positions": np.concatenate([np.arange(d, dtype=np.int32), np.repeat(bounds, s) + j]),
            "limit": np.concatenate([np.arange(1, d + 1, dtype=np.int32), np.repeat(bounds, s)]),
            "group": np.concatenate([np.zeros(d, np.int32), np.repeat(np.arange(1, len(ends) + 1, dtype=np.int32), s)])}


@dataclass(frozen=True)
class JudgeExample:
    prompt: str
    steps: tuple[str, ...]
    final_answer: str | None
    correct: bool


class Encoder:
    """Task text -> ids (BOS/EOS from the tokenizer; judge words must be one token each)."""

    def __init__(self, tokenizer, task: Task) -> None:
        self.tok = tokenizer
        self.task = task
        if tokenizer.bos_id is None or tokenizer.eos_id is None:
            raise ConfigError("the training tokenizer needs BOS and EOS tokens")
        self.bos, self.eos = tokenizer.bos_id, tokenizer.eos_id
        self.judge_ids = {}
        for ok in (True, False):
            ids = tokenizer.encode(task.judge_word(ok))
            if len(ids) != 1:
                raise ConfigError(f"judge word {task.judge_word(ok)!r} is not exactly one token: {ids}")
            self.judge_ids[ok] = ids[0]
        probe = "( 1 + 2 ) :"
        full = tokenizer.encode(task.verify_prompt(probe, []))
        self.suffix = full[len(tokenizer.encode(probe)):]
        if not self.suffix:
            raise ConfigError("the task's verification suffix encodes to no tokens")

    def prompt_ids(self, prompt: str) -> list[int]:
        return [self.bos, *self.tok.encode(prompt)]

    def judge_row(self, ex: JudgeExample) -> list[int]:
        """A standalone verification prompt and its judge word (evaluation scores these)."""
        text = self.task.verify_prompt(ex.prompt, list(ex.steps), ex.final_answer)
        return [*self.prompt_ids(text), self.judge_ids[ex.correct]]

    def solution_row(self, prompt: str, text: str, judge: bool) -> dict[str, np.ndarray]:
        """One training row (unpadded) for `text` as a solution of `prompt`; judge copies when `judge`."""
        ctx = self.prompt_ids(prompt)
        c, suffix = len(ctx), self.suffix
        exs = prefixes(self.task, prompt, text)
        # each prefix's solution text as ids: its verification prompt without context, suffix and judge word
        prefix_ids = [self.judge_row(ex)[c: -1 - len(suffix)] for ex in exs]
        labels = [ex.correct for ex in exs]
        ids = prefix_ids[-1] if exs else []
        # LM loss on the longest clean prefix (and EOS after a correct final answer)
        lm_end = max([len(p) for p, ok in zip(prefix_ids, labels) if ok], default=0)
        if exs and exs[-1].final_answer is not None and exs[-1].correct:
            ids = [*ids, self.eos]
            lm_end = len(ids)
        draft = [*ctx, *ids]
        if judge and prefix_ids:
            bounds = [c + len(p) for p in prefix_ids]
            row = packed_row(draft, bounds, suffix)
            tokens, positions, limit, group = row["tokens"], row["positions"], row["limit"], row["group"]
        else:
            labels = []
            tokens = np.asarray(draft, np.int32)
            positions = np.arange(len(draft), dtype=np.int32)
            limit, group = positions + 1, np.zeros(len(draft), np.int32)
        n = len(tokens)
        targets = np.full(n, PAD_ID, np.int32)
        targets[: len(draft) - 1] = draft[1:]
        lm_mask = np.zeros(n, np.float32)
        lm_mask[c - 1: c + lm_end - 1] = 1.0
        judge_mask = np.zeros(n, np.float32)
        s = len(suffix)
        for k, ok in enumerate(labels):
            start = len(draft) + k * s
            targets[start: start + s - 1] = suffix[1:]  # inside a copy: the next suffix token (no loss)
            targets[start + s - 1] = self.judge_ids[ok]
            judge_mask[start + s - 1] = 1.0
        return {"tokens": tokens, "targets": targets, "positions": positions, "limit": limit, "group": group,
                "lm_mask": lm_mask, "judge_mask": judge_mask}


def prefixes(task: Task, prompt: str, text: str) -> list[JudgeExample]:
    """Every step-boundary prefix of a (generated or synthetic) solution, plus the full answer when it has one,
    each labelled with `task.prefix_correct`."""
    steps = task.steps(text)
    out = [JudgeExample(prompt, tuple(steps[:k]), None, task.prefix_correct(prompt, steps[:k]))
           for k in range(1, len(steps) + 1)]
    ans = task.final_answer(text)
    if ans is not None:
        out.append(JudgeExample(prompt, tuple(steps), ans, task.prefix_correct(prompt, steps, ans)))
    return out


@dataclass(frozen=True)
class RowMix:
    """Which solutions a stream's rows hold: with probability `real_fraction` a real draft output from `samples`
    ((prompt, text) pairs; those that fit), else with probability `error_fraction` a synthetic corruption of a
    random-order solution, else a clean random-order solution."""

    error_fraction: float = 0.0
    real_fraction: float = 0.0
    samples: Sequence[tuple[str, str]] = ()


class BatchStream:
    """Deterministic batches: `batch(step)` depends only on (seed, step).

    Rows are drawn as `mix` says (default: clean solutions only). `judge=False` (the draft's stream) gives plain
    language-modelling rows."""

    def __init__(self, task: Task, encoder: Encoder, seq_len: int, batch_size: int, seed: int, *,
                 judge: bool = False, mix: RowMix = RowMix(), split: str = "train") -> None:
        if split == "test":
            raise ConfigError("training data must not come from the held-out split")
        self.task, self.enc, self.seq_len, self.batch_size = task, encoder, seq_len, batch_size
        self.seed, self.split, self.judge = seed, split, judge
        self.error_fraction, self.real_fraction = mix.error_fraction, mix.real_fraction
        # real draft outputs that fit, as rows: built once, reused by every batch
        self.samples = [row for row in (encoder.solution_row(p, t, judge) for p, t in mix.samples)
                        if len(row["tokens"]) <= seq_len]
        if mix.real_fraction > 0 and not self.samples:
            raise ConfigError("real_fraction > 0 needs draft samples that fit in seq_len")

    def _rng(self, step: int) -> random.Random:
        return random.Random(f"{self.seed}:{step}")

    def row(self, rng: random.Random) -> dict[str, np.ndarray]:
        if self.samples and rng.random() < self.real_fraction:
            return self.samples[rng.randrange(len(self.samples))]
        prompt = self.task.sample(rng, self.split)
        text = self.task.solve(prompt, rng)
        if rng.random() < self.error_fraction:
            text, _ = self.task.corrupt(prompt, text, rng)
        return self.enc.solution_row(prompt, text, self.judge)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = self._rng(step)
        b, length = self.batch_size, self.seq_len
        out = {k: np.zeros((b, length), np.float32 if k.endswith("mask") else np.int32)
               for k in ("tokens", "targets", "positions", "limit", "group", "lm_mask", "judge_mask")}
        out["limit"][:] = np.arange(1, length + 1, dtype=np.int32)  # padding: causal, never a loss target
        out["positions"][:] = np.arange(length, dtype=np.int32)
        for i in range(b):
            for _ in range(1000):
                row = self.row(rng)
                if len(row["tokens"]) <= length:
                    break
            else:
                raise ConfigError(f"seq_len {length} is too short for this task's rows (one needs "
                                  f"{len(row['tokens'])} tokens)")
            n = len(row["tokens"])
            for k, v in row.items():
                out[k][i, :n] = v
        return out
