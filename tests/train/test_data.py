"""Batches: static shapes, loss masks on the solution / judge tokens only, determinism, balanced labels."""

import random

import numpy as np
import pytest

from parse_jax.errors import ConfigError
from parse_jax.train.data import BatchStream, JudgePool, prefixes


def _decode(tok, ids):
    return tok.decode([int(i) for i in ids])


@pytest.mark.parametrize("seed", [0, 7])
def test_lm_rows_mask_exactly_the_solution_and_eos(tok, task, enc, seed):
    s = BatchStream(task, enc, 40, 16, seed)
    b = s.batch(5)
    assert b["tokens"].shape == (16, 41) and b["lm_mask"].shape == (16, 40) and b["judge_mask"].shape == (16, 40)
    assert b["judge_mask"].sum() == 0
    for row, mask in zip(b["tokens"], b["lm_mask"]):
        assert row[0] == tok.bos_id
        targets = row[1:]
        on = np.flatnonzero(mask)
        assert on.size and np.all(np.diff(on) == 1)  # one contiguous run
        text = _decode(tok, row[1: on[0] + 1])  # the prompt: everything before the first loss target
        assert text.endswith(":") and not task.is_heldout(text)
        sol = targets[on]
        assert sol[-1] == tok.eos_id and tok.eos_id not in sol[:-1]
        solution = _decode(tok, sol[:-1])
        assert task.grade_steps(text, solution) == [True] * 3 and task.grade(text, solution)
        assert np.all(targets[on[-1] + 1:] == 0)  # padding after EOS, no loss on it


def test_judge_rows_mask_only_the_judge_word_with_the_right_label(tok, task, enc):
    s = BatchStream(task, enc, 40, 64, 1, judge_fraction=0.5)
    b = s.batch(0)
    assert b["lm_mask"][:32].sum() > 0 and b["lm_mask"][32:].sum() == 0 and b["judge_mask"][:32].sum() == 0
    labels = []
    for row, mask in zip(b["tokens"][32:], b["judge_mask"][32:]):
        on = np.flatnonzero(mask)
        assert on.size == 1
        word = int(row[1:][on[0]])
        assert word in (enc.judge_ids[True], enc.judge_ids[False])
        text = _decode(tok, row[1: on[0] + 1])
        assert text.endswith(task.VERIFY_SUFFIX.strip())
        prompt, rest = text.split(" : ", 1)
        prompt += " :"
        body = rest[: -len(task.VERIFY_SUFFIX)].strip()
        steps = task.steps(body)
        ans = task.final_answer(body)
        assert (word == enc.judge_ids[True]) == task.prefix_correct(prompt, steps, ans)
        labels.append(word == enc.judge_ids[True])
        assert np.all(row[on[0] + 2:] == 0)
    assert 0.25 < np.mean(labels) < 0.75


def test_batches_depend_only_on_seed_and_step(task, enc):
    a = BatchStream(task, enc, 40, 8, 4, judge_fraction=0.25)
    b = BatchStream(task, enc, 40, 8, 4, judge_fraction=0.25)
    for k in ("tokens", "lm_mask", "judge_mask"):
        np.testing.assert_array_equal(a.batch(3)[k], b.batch(3)[k])
    assert not np.array_equal(a.batch(3)["tokens"], a.batch(4)["tokens"])


def test_training_data_never_comes_from_the_held_out_split(task, enc):
    with pytest.raises(ConfigError, match="held-out"):
        BatchStream(task, enc, 40, 8, 0, split="test")


def test_prefixes_cut_at_every_step_and_the_answer(task):
    rng = random.Random(0)
    prompt = task.sample(rng, "train")
    sol = task.solve(prompt, rng)
    exs = prefixes(task, prompt, sol)
    assert [len(e.steps) for e in exs] == [1, 2, 3, 3] and exs[-1].final_answer == task.answer(prompt)
    assert all(e.correct for e in exs)
    bad, idx = task.corrupt(prompt, sol, rng)
    marks = [e.correct for e in prefixes(task, prompt, bad)]
    assert marks == [k < idx for k in range(3)] + [False]


def test_real_draft_outputs_feed_the_judge_pool(task, enc):
    rng = random.Random(2)
    ps = [task.sample(rng, "train") for _ in range(6)]
    samples = [(p, task.solve(p, rng)) for p in ps[:3]] + [(p, task.corrupt(p, task.solve(p), rng)[0]) for p in ps[3:]]
    samples.append((ps[0], "1 + 1 = 2 ; junk junk"))
    pool = JudgePool(task, samples, 41, enc)
    assert len(pool.good) >= 12 and len(pool.bad) >= 3
    s = BatchStream(task, enc, 40, 32, 0, judge_fraction=1.0, real_fraction=1.0, pool=pool)
    assert s.batch(0)["judge_mask"].sum() == 32
