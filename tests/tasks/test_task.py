"""The embedded task: generation, exact step grading, several correct orders, corruptions, verification format."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parse_jax.errors import ConfigError, InputError
from parse_jax.tasks import (
    CORRUPTIONS,
    DELIMITER,
    JUDGE_NO,
    JUDGE_YES,
    PRESETS,
    SYMBOLS,
    VERIFY_SUFFIX,
    Task,
    TaskConfig,
    load_task,
)

TASKS = {name: load_task(name) for name in PRESETS}
seeds = st.integers(0, 2**32 - 1)
names = st.sampled_from(sorted(PRESETS))
FAST = settings(max_examples=25, deadline=None)


def test_load_task_and_constants():
    t = load_task()
    assert isinstance(t, Task) and t.config == TaskConfig()
    assert (t.DELIMITER, t.VERIFY_SUFFIX, t.JUDGE_YES, t.JUDGE_NO) == (DELIMITER, VERIFY_SUFFIX, "Correct",
                                                                       "Incorrect")
    assert JUDGE_YES == "Correct" and JUDGE_NO == "Incorrect"
    with pytest.raises(ConfigError, match="unknown task"):
        load_task("nope")


@pytest.mark.parametrize("kwargs", [dict(shapes=()), dict(shapes=("x",)), dict(shapes=("x o x o x",)),
                                    dict(shapes=("(x o x",)), dict(shapes=("x + x",)), dict(ops=("/",)),
                                    dict(ops=()), dict(ops=("+", "+")), dict(modulus=11), dict(modulus=1),
                                    dict(heldout_fraction=0.0)])
def test_bad_config(kwargs):
    with pytest.raises(ConfigError):
        TaskConfig(**kwargs)


def _check_correct(task, prompt, text):
    prob = task.parse(prompt)
    steps = task.steps(text)
    assert len(steps) == prob.n_steps
    assert task.grade(prompt, text)
    assert task.grade_steps(prompt, text) == [True] * prob.n_steps
    assert task.final_answer(text) == task.answer(prompt) == str(prob.value)
    for k in range(len(steps) + 1):
        assert task.prefix_correct(prompt, steps[:k])
    assert task.prefix_correct(prompt, steps, task.final_answer(text))
    assert set(text.split()) <= set(SYMBOLS)


@FAST
@given(name=names, seed=seeds)
def test_every_solution_grades_correct(name, seed):
    task = TASKS[name]
    rng = random.Random(seed)
    for prompt, ref in task.problems(8, seed):
        assert ref == task.solve(prompt)  # the reference is the canonical solution
        _check_correct(task, prompt, ref)
        for _ in range(3):
            _check_correct(task, prompt, task.solve(prompt, rng))
    # an int seed and a numpy Generator are accepted as rngs too
    prompt = task.problems(1, seed)[0][0]
    _check_correct(task, prompt, task.solve(prompt, seed))
    _check_correct(task, prompt, task.solve(prompt, np.random.default_rng(seed)))


def test_several_correct_orders():
    task = load_task()
    probs = task.problems(300, 1)
    multi = [p for p, _ in probs if len(task.all_solutions(p)) >= 2]
    assert len(multi) >= 0.9 * len(probs)  # only problems with two identical sub-expressions have one
    for p in multi[:50]:
        sols = task.all_solutions(p)
        assert len({tuple(s.split()) for s in sols}) == len(sols)  # token-wise different
        for s in sols:
            _check_correct(task, p, s)
    # random solving reaches every order
    hard = load_task("hard")
    p = next(p for p, _ in hard.problems(200, 2) if hard.parse(p).n_steps == 5 and len(hard.all_solutions(p)) == 8)
    rng = random.Random(0)
    assert {hard.solve(p, rng) for _ in range(400)} == set(hard.all_solutions(p))
    assert hard.all_solutions(p)[0] == hard.solve(p)


def test_canonical_order_is_left_to_right():
    task = load_task()
    p = "( 3 + 4 ) * ( 5 - 2 ) :"
    assert task.solve(p) == "3 + 4 = 7 ; 5 - 2 = 3 ; 7 * 3 = 1 ; answer 1"
    assert task.all_solutions(p) == [task.solve(p), "5 - 2 = 3 ; 3 + 4 = 7 ; 7 * 3 = 1 ; answer 1"]


def test_problems_deterministic_and_split():
    task = load_task()
    a = task.problems(50, 7)
    assert a == task.problems(50, 7)
    assert a[:20] == task.problems(20, 7)
    assert a != task.problems(50, 8)
    assert len({p for p, _ in a}) > 40
    assert all(task.is_heldout(p) for p, _ in a)
    train = task.problems(200, 7, split="train")
    assert not any(task.is_heldout(p) for p, _ in train)
    everything = task.problems(2000, 3, split="all")
    frac = np.mean([task.is_heldout(p) for p, _ in everything])
    assert 0.05 < frac < 0.15
    assert task.problems(0, 1) == []
    with pytest.raises(InputError):
        task.problems(3, 0, split="dev")
    with pytest.raises(InputError):
        task.problems(-1, 0)


def test_presets_cover_step_counts():
    for name, steps in [("default", {3}), ("easy", {3}), ("medium", {3, 4}), ("hard", {3, 4, 5})]:
        task = TASKS[name]
        assert {task.parse(p).n_steps for p, _ in task.problems(300, 0, split="all")} == steps


def test_tiny_modulus():
    task = Task(TaskConfig(shapes=("x o x",), ops=("+",), modulus=2, heldout_fraction=0.5))
    for p, s in task.problems(20, 0, split="all"):
        _check_correct(task, p, s)


# -- grading -------------------------------------------------------------------------------------------------


@FAST
@given(name=names, seed=seeds)
def test_grade_rejects_wrong_final_answers(name, seed):
    task = TASKS[name]
    for prompt, ref in task.problems(5, seed, split="all"):
        steps = task.steps(ref)
        right = task.answer(prompt)
        for d in range(10):
            text = " ".join(f"{s} ;" for s in steps) + f" answer {d}"
            assert task.grade(prompt, text) == (str(d) == right)
        assert not task.grade(prompt, " ".join(f"{s} ;" for s in steps))  # no final answer
        assert not task.grade(prompt, ref.rsplit(" ", 1)[0])  # "answer" with nothing after it
        assert not task.grade(prompt, f"answer {right}2")
        # trailing text, EOS and junk after the answer are ignored; only the first answer counts
        assert task.grade(prompt, ref + " <eos> <pad> ; 1 + 1 = 2 answer 9")
        assert task.grade(prompt, ref + "<eos>")
        wrong = str((int(right) + 1) % 10)
        assert not task.grade(prompt, f"answer {wrong} answer {right}")


@FAST
@given(words=st.lists(st.sampled_from([*SYMBOLS, "<eos>", "x", "\n", ";;"]), max_size=40), raw=st.text(max_size=30))
def test_garbage_never_crashes_and_only_right_answers_pass(words, raw):
    task = load_task()
    text = " ".join(words) + raw
    prompt = "( 3 + 4 ) * ( 5 - 2 ) :"
    marks = task.grade_steps(prompt, text)
    assert len(marks) == len(task.steps(text))
    assert task.grade(prompt, text) == (task.final_answer(text) == "1")


def test_grade_garbage():
    task = load_task()
    p = "( 3 + 4 ) * ( 5 - 2 ) :"
    for text in ["", "hello", "answer", ";;;", "7 * 3 = 1 answer", "answer x1", "1", "answer  "]:
        assert not task.grade(p, text)
    assert task.grade_steps(p, "") == []
    assert task.grade_steps(p, "3 + 4 = 7 ; ; 5 - 2 = 3 ;") == [True, False, True]
    assert task.grade_steps(p, "3 + 4 = 7 ; 5 - 2") == [True, False]  # truncated step
    with pytest.raises(InputError, match="grade: text must be a string"):
        task.grade(p, None)
    with pytest.raises(InputError):
        task.grade("3 + 4 =", "answer 7")
    with pytest.raises(InputError):
        task.grade("( 3 + 4 :", "answer 7")


@pytest.mark.parametrize("text, marks", [
    ("3 + 4 = 7 ; 5 - 2 = 3 ; 7 * 3 = 1", [True, True, True]),
    ("5 - 2 = 3 ; 3 + 4 = 7 ; 7 * 3 = 1", [True, True, True]),
    ("4 + 3 = 7 ; 5 - 2 = 3 ; 7 * 3 = 1", [False, True, False]),  # operands not as written; root not ready
    ("3 + 4 = 8 ; 5 - 2 = 3 ; 8 * 3 = 4", [False, True, False]),  # wrong result, carried forward
    ("3 + 4 = 7 ; 3 + 4 = 7 ; 5 - 2 = 3", [True, False, True]),  # an operation evaluated twice
    ("7 * 3 = 1 ; 3 + 4 = 7 ; 5 - 2 = 3", [False, True, True]),  # the root before its operands
    ("4 * 5 = 0 ; 3 + 4 = 7", [False, True]),  # not a sub-expression
    ("3 * 4 = 2", [False]),  # wrong operator
    ("3 + 4 = 17", [False]),  # not a digit
    ("3 + 4 = 7 = 7", [False]),  # malformed
])
def test_grade_steps_cases(text, marks):
    assert load_task().grade_steps("( 3 + 4 ) * ( 5 - 2 ) :", text) == marks


def test_identical_sub_expressions_try_every_matching():
    task = load_task("medium")
    p = "( 3 + 4 ) * ( ( 3 + 4 ) - 1 ) :"
    # the first "3 + 4" is the right one here; matching it to the left copy would reject "7 - 1 = 6"
    text = "3 + 4 = 7 ; 7 - 1 = 6 ; 3 + 4 = 7 ; 7 * 6 = 2 ; answer 2"
    _check_correct(task, p, text)
    assert task.grade_steps(p, "3 + 4 = 7 ; 3 + 4 = 7 ; 3 + 4 = 7") == [True, True, False]
    assert len(task.all_solutions(p)) == 2  # 3 orders, two of them the same text
    _check_correct(task, "( 3 + 4 ) * ( 3 + 4 ) :", "3 + 4 = 7 ; 3 + 4 = 7 ; 7 * 7 = 9 ; answer 9")


def test_steps_and_final_answer_parsing():
    task = load_task()
    assert task.steps("a b ; c ;") == ["a b", "c"]
    assert task.steps("a  b ; c ; answer 3 ; d") == ["a b", "c"]
    assert task.steps("") == []
    assert task.final_answer("1 + 1 = 2 ; answer 2 <eos> answer 3") == "2"
    assert task.final_answer("answer 7<eos>") == "7"
    assert task.final_answer("answer") is None and task.final_answer("no answer here") is not None
    assert task.final_answer("x") is None


def test_prefix_correct_with_final_answer():
    task = load_task()
    p = "( 3 + 4 ) * ( 5 - 2 ) :"
    steps = ["3 + 4 = 7", "5 - 2 = 3", "7 * 3 = 1"]
    assert task.prefix_correct(p, steps, "1")
    assert not task.prefix_correct(p, steps, "2")
    assert not task.prefix_correct(p, steps[:2], "1")  # an answer before every operation is evaluated
    assert not task.prefix_correct(p, ["3 + 4 = 8"])


# -- corruptions ---------------------------------------------------------------------------------------------


def _check_corrupted(task, prompt, solution, text, idx):
    marks = task.grade_steps(prompt, text)
    assert len(marks) == len(task.steps(solution))
    assert not marks[idx] and all(marks[:idx])
    assert task.steps(text)[:idx] == task.steps(solution)[:idx]
    steps = task.steps(text)
    assert task.prefix_correct(prompt, steps[:idx])
    assert not task.prefix_correct(prompt, steps[: idx + 1])
    assert task.final_answer(text) is not None
    assert set(text.split()) <= set(SYMBOLS)


@FAST
@given(name=names, seed=seeds)
def test_corruptions_grade_wrong_at_their_step(name, seed):
    task = TASKS[name]
    rng = random.Random(seed)
    for prompt, ref in task.problems(6, seed, split="all"):
        for sol in (ref, task.solve(prompt, rng)):
            text, idx = task.corrupt(prompt, sol, rng)
            assert 0 <= idx < task.parse(prompt).n_steps
            _check_corrupted(task, prompt, sol, text, idx)


def test_corruption_statistics():
    task = load_task()
    rng = random.Random(0)
    wrong_final, idxs = 0, []
    probs = task.problems(400, 5, split="all")
    for prompt, _ in probs:
        text, idx = task.corrupt(prompt, task.solve(prompt, rng), rng)
        wrong_final += not task.grade(prompt, text)
        idxs.append(idx)
    assert wrong_final >= 0.75 * len(probs)  # usually wrong; errors can cancel (e.g. a later "* 0")
    assert set(idxs) == {0, 1, 2}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_each_corruption_kind(kind):
    task = load_task("hard")
    rng = random.Random(1)
    made = 0
    for prompt, ref in task.problems(60, 11, split="all"):
        n = task.parse(prompt).n_steps
        for step in range(n):
            try:
                text, idx = task.corrupt(prompt, ref, rng, step=step, kind=kind)
            except InputError:
                assert kind != "result"
                continue
            assert idx == step
            _check_corrupted(task, prompt, ref, text, idx)
            bad = task.steps(text)[idx].split()
            good = task.steps(ref)[idx].split()
            if kind == "result":
                assert bad[:4] == good[:4] and bad[4] != good[4]
            elif kind == "operator":
                assert bad[1] != good[1] and (bad[0], bad[2]) == (good[0], good[2])
            elif kind == "operand":
                assert bad[1] == good[1] and (bad[0] != good[0]) != (bad[2] != good[2])
            made += 1
    assert made > 100


def test_corrupt_bad_input():
    task = load_task()
    p = "( 3 + 4 ) * ( 5 - 2 ) :"
    with pytest.raises(InputError, match="complete correct solution"):
        task.corrupt(p, "3 + 4 = 8 ; 5 - 2 = 3 ; 8 * 3 = 4 ; answer 4")
    with pytest.raises(InputError, match="complete correct solution"):
        task.corrupt(p, "3 + 4 = 7 ; answer 1")
    with pytest.raises(InputError, match="out of range"):
        task.corrupt(p, task.solve(p), step=3)
    with pytest.raises(InputError, match="kind"):
        task.corrupt(p, task.solve(p), kind="typo")
    plus = Task(TaskConfig(ops=("+",)))
    with pytest.raises(InputError, match="no corruption"):
        plus.corrupt(p, plus.solve(p), step=0, kind="operator")  # one operator: nothing to swap in
    # deterministic for a given rng seed
    assert task.corrupt(p, task.solve(p), 3) == task.corrupt(p, task.solve(p), 3)


# -- verification format -------------------------------------------------------------------------------------


@FAST
@given(name=names, seed=seeds)
def test_verify_prompt_is_the_solution_prefix_plus_suffix(name, seed):
    task = TASKS[name]
    rng = random.Random(seed)
    for prompt, _ in task.problems(4, seed, split="all"):
        sol = task.solve(prompt, rng)
        steps = task.steps(sol)
        toks = sol.split()
        cuts = [i + 1 for i, t in enumerate(toks) if t == DELIMITER]
        for k, cut in enumerate(cuts, start=1):
            v = task.verify_prompt(prompt, steps[:k])
            assert v == prompt + " " + " ".join(toks[:cut]) + VERIFY_SUFFIX
            assert v.endswith(VERIFY_SUFFIX)
        full = task.verify_prompt(prompt, steps, task.final_answer(sol))
        assert full == f"{prompt} {sol}{VERIFY_SUFFIX}"
        assert task.verify_prompt(prompt, []) == prompt + VERIFY_SUFFIX
    assert task.judge_word(True) == JUDGE_YES and task.judge_word(False) == JUDGE_NO
