"""Batches: static shapes, packed verification copies that equal standalone verification prompts, loss masks on
the clean solution tokens and the judge words only, labels from the grader, determinism."""

import random

import numpy as np
import pytest

from pallas_kernels.reference import visibility
from parse_jax.errors import ConfigError
from parse_jax.train.data import BatchStream, RowMix, prefixes


def _decode(tok, ids):
    return tok.decode([int(i) for i in ids])


def _visible(b, i):
    """Tokens (in row order) that position i of every row sees."""
    vis = np.asarray(visibility(np.zeros(b["tokens"].shape[0], np.int32), b["limit"], b["group"],
                                b["tokens"].shape[1]))
    return vis[:, i]


@pytest.mark.parametrize("seed", [0, 7])
def test_lm_rows_mask_exactly_the_solution_and_eos(tok, task, enc, seed):
    s = BatchStream(task, enc, 40, 16, seed)
    b = s.batch(5)
    assert all(b[k].shape == (16, 40) for k in b)
    assert b["judge_mask"].sum() == 0
    for row, tgt, mask, pos in zip(b["tokens"], b["targets"], b["lm_mask"], b["positions"]):
        assert row[0] == tok.bos_id and np.array_equal(pos, np.arange(40))
        np.testing.assert_array_equal(tgt[:-1], row[1:])  # plain next-token targets
        on = np.flatnonzero(mask)
        assert on.size and np.all(np.diff(on) == 1)  # one contiguous run
        text = _decode(tok, row[1: on[0] + 1])  # the prompt: everything before the first loss target
        assert text.endswith(":") and not task.is_heldout(text)
        sol = tgt[on]
        assert sol[-1] == tok.eos_id and tok.eos_id not in sol[:-1]
        solution = _decode(tok, sol[:-1])
        assert task.grade_steps(text, solution) == [True] * 3 and task.grade(text, solution)
        assert np.all(row[on[-1] + 2:] == 0)  # padding after EOS, no loss on it


def _check_row(tok, task, enc, b, r):
    """Every judge target of row r is the label of exactly the verification prompt its copy sees; the LM mask
    covers the solution up to the first wrong step."""
    tokens, targets = b["tokens"][r], b["targets"][r]
    vis = _visible({k: v[r: r + 1] for k, v in b.items()}, slice(None))[0]
    labels = []
    for i in np.flatnonzero(b["judge_mask"][r]):
        seen = np.flatnonzero(vis[i])
        # the copy sees a plain prefix of the row, then its own suffix tokens, at consecutive positions
        text_ids = tokens[seen]
        np.testing.assert_array_equal(b["positions"][r][seen], np.arange(len(seen)))
        assert np.array_equal(text_ids[-len(enc.suffix):], enc.suffix)
        text = _decode(tok, text_ids[1:])
        prompt, rest = text.split(" : ", 1)
        prompt += " :"
        body = rest[: -len(task.VERIFY_SUFFIX)].strip()
        ok = task.prefix_correct(prompt, task.steps(body), task.final_answer(body))
        assert text == task.verify_prompt(prompt, task.steps(body), task.final_answer(body))
        assert targets[i] == enc.judge_ids[ok]
        labels.append(ok)
    on = np.flatnonzero(b["lm_mask"][r])
    if on.size:
        prompt = _decode(tok, tokens[1: on[0] + 1])
        learned = _decode(tok, targets[on][targets[on] != tok.eos_id])
        steps = task.steps(learned)
        assert steps and all(task.grade_steps(prompt, learned))
    return labels


def test_packed_rows_label_every_prefix_as_its_own_verification_prompt(tok, task, enc):
    s = BatchStream(task, enc, 44, 32, 1, judge=True, mix=RowMix(error_fraction=0.5))
    b = s.batch(0)
    labels = [x for r in range(32) for x in _check_row(tok, task, enc, b, r)]
    assert len(labels) >= 32 * 3 and 0.25 < np.mean(labels) < 0.85
    assert b["lm_mask"].sum() > 0


def test_a_corrupted_solution_is_clean_before_the_wrong_step_and_wrong_from_it(tok, task, enc):
    rng = random.Random(3)
    prompt = task.sample(rng, "train")
    bad, idx = task.corrupt(prompt, task.solve(prompt, rng), rng, step=1)
    row = enc.solution_row(prompt, bad, judge=True)
    labels = [row["targets"][i] == enc.judge_ids[True] for i in np.flatnonzero(row["judge_mask"])]
    assert labels == [True, False, False, False]
    learned = _decode(tok, row["targets"][row["lm_mask"] > 0])
    assert task.steps(learned) == task.steps(bad)[:1]


def test_batches_depend_only_on_seed_and_step(task, enc):
    a = BatchStream(task, enc, 44, 8, 4, judge=True, mix=RowMix(error_fraction=0.5))
    b = BatchStream(task, enc, 44, 8, 4, judge=True, mix=RowMix(error_fraction=0.5))
    for k in a.batch(3):
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


def test_real_draft_outputs_become_rows_with_their_graded_labels(tok, task, enc):
    rng = random.Random(2)
    ps = [task.sample(rng, "train") for _ in range(6)]
    samples = [(p, task.solve(p, rng)) for p in ps[:3]] + [(p, task.corrupt(p, task.solve(p), rng)[0]) for p in ps[3:]]
    samples.append((ps[0], "1 + 1 = 2 ; 3 3 = ; answer"))  # malformed steps
    samples.append((ps[1], " ".join(["1 + 1 = 2 ;"] * 12)))  # too long for a row: dropped
    s = BatchStream(task, enc, 44, 16, 0, judge=True, mix=RowMix(real_fraction=0.99, samples=samples))
    assert len(s.samples) == 7
    b = s.batch(0)
    labels = [x for r in range(16) for x in _check_row(tok, task, enc, b, r)]
    assert True in labels and False in labels


def test_real_fraction_without_samples_is_an_error(task, enc):
    with pytest.raises(ConfigError, match="draft samples"):
        BatchStream(task, enc, 44, 8, 0, judge=True, mix=RowMix(real_fraction=0.5))


def test_a_seq_len_too_short_for_the_rows_is_an_error(task, enc):
    with pytest.raises(ConfigError, match="seq_len 30 is too short"):
        BatchStream(task, enc, 30, 4, 0, judge=True).batch(0)
