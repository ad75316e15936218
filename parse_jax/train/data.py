"""Training batches with static shapes: every row is padded to `seq_len + 1` tokens, with loss masks.

Rows:
- language modelling: ``BOS prompt solution EOS``; the loss covers the solution and EOS only. Solutions use a
  random valid step order (``task.solve(prompt, rng)``).
- judge: ``BOS verify_prompt(prompt, steps_so_far[, final_answer]) judge_word``; the loss covers the judge word
  only. Labels are balanced (clean / erroneous prefixes). Prefixes are cut at every step boundary and at the full
  answer; erroneous ones come from synthetic corruptions (``task.corrupt``) or from real draft outputs labelled
  with ``task.prefix_correct``.

A batch is a dict of numpy arrays: ``tokens`` int32 [B, L+1], ``lm_mask`` and ``judge_mask`` float32 [B, L]
aligned with the targets ``tokens[:, 1:]``. Batch `step` of a stream depends only on (seed, step), so the data
RNG state of a run is its step counter and a resumed run sees exactly the batches an uninterrupted one sees.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.tasks import Task

PAD_ID = 0


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

    def prompt_ids(self, prompt: str) -> list[int]:
        return [self.bos, *self.tok.encode(prompt)]

    def lm_row(self, prompt: str, solution: str) -> tuple[list[int], int]:
        """(ids, index of the first loss target): loss on solution tokens and EOS."""
        p = self.prompt_ids(prompt)
        return [*p, *self.tok.encode(solution), self.eos], len(p)

    def judge_row(self, ex: JudgeExample) -> list[int]:
        text = self.task.verify_prompt(ex.prompt, list(ex.steps), ex.final_answer)
        return [*self.prompt_ids(text), self.judge_ids[ex.correct]]


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


class JudgePool:
    """Labelled prefixes of real draft outputs, split by label."""

    def __init__(self, task: Task, samples: Sequence[tuple[str, str]], max_len: int, encoder: Encoder) -> None:
        self.good: list[JudgeExample] = []
        self.bad: list[JudgeExample] = []
        for prompt, text in samples:
            for ex in prefixes(task, prompt, text):
                if len(encoder.judge_row(ex)) <= max_len:
                    (self.good if ex.correct else self.bad).append(ex)


class BatchStream:
    """Deterministic batches: `batch(step)` depends only on (seed, step)."""

    def __init__(self, task: Task, encoder: Encoder, seq_len: int, batch_size: int, seed: int,
                 judge_fraction: float = 0.0, real_fraction: float = 0.0, pool: JudgePool | None = None,
                 split: str = "train") -> None:
        if split == "test":
            raise ConfigError("training data must not come from the held-out split")
        self.task, self.enc, self.seq_len, self.batch_size = task, encoder, seq_len, batch_size
        self.seed, self.split = seed, split
        self.n_judge = int(round(batch_size * judge_fraction))
        self.real_fraction = real_fraction
        self.pool = pool

    def _rng(self, step: int) -> random.Random:
        return random.Random(f"{self.seed}:{step}")

    def _synthetic(self, rng: random.Random, correct: bool) -> JudgeExample:
        prompt = self.task.sample(rng, self.split)
        sol = self.task.solve(prompt, rng)
        if correct:
            cands = [e for e in prefixes(self.task, prompt, sol) if e.correct]
        else:
            bad, _ = self.task.corrupt(prompt, sol, rng)
            cands = [e for e in prefixes(self.task, prompt, bad) if not e.correct]
        return cands[rng.randrange(len(cands))]

    def judge_example(self, rng: random.Random) -> JudgeExample:
        correct = rng.random() < 0.5
        if self.pool is not None and rng.random() < self.real_fraction:
            src = self.pool.good if correct else self.pool.bad
            if src:  # a label the draft never produced falls back to synthetic data
                return src[rng.randrange(len(src))]
        return self._synthetic(rng, correct)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = self._rng(step)
        b, length = self.batch_size, self.seq_len
        tokens = np.full((b, length + 1), PAD_ID, np.int32)
        lm_mask = np.zeros((b, length), np.float32)
        judge_mask = np.zeros((b, length), np.float32)
        for i in range(b):
            while True:
                if i < b - self.n_judge:
                    prompt = self.task.sample(rng, self.split)
                    ids, start = self.enc.lm_row(prompt, self.task.solve(prompt, rng))
                    is_judge = False
                else:
                    ids = self.enc.judge_row(self.judge_example(rng))
                    start, is_judge = len(ids) - 1, True
                if len(ids) <= length + 1:
                    break
            tokens[i, : len(ids)] = ids
            # target index j predicts tokens[j + 1]
            (judge_mask if is_judge else lm_mask)[i, start - 1: len(ids) - 1] = 1.0
        return {"tokens": tokens, "lm_mask": lm_mask, "judge_mask": judge_mask}
