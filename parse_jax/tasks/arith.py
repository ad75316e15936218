"""Modular arithmetic, one operation per step: the embedded step-by-step task.

A problem is a fully parenthesised expression over single digits, evaluated modulo 10 (by default),
followed by the prompt end mark ``:``::

    ( 3 + 4 ) * ( 5 - 2 ) :

A solution evaluates one operation per step, steps separated by the delimiter ``;``, then the final answer::

    3 + 4 = 7 ; 5 - 2 = 3 ; 7 * 3 = 1 ; answer 1

Every text the task writes is a sequence of space-separated symbols (digits, ``+ - *``, ``( )``, ``: ; = |``,
``answer check Correct Incorrect``), so a WordLevel tokenizer covers it exactly and token boundaries are text
boundaries: ``encode(a + " " + b) == encode(a) + encode(b)``.

Why it has the properties the embedded pair needs:

(a) steps and a final answer: ``s1 ; s2 ; ... ; answer v``; segmenting on the delimiter gives one segment per step;
(b) several correct step sequences: independent sub-expressions (``3 + 4`` and ``5 - 2``) may be evaluated in either
    order, so a correct draft often differs token by token from the target's greedy solution;
(c) exact grading: a step ``x o y = z`` is correct iff some not yet evaluated sub-expression of the problem whose
    operands are already known (digits of the problem, or results of earlier correct steps) is exactly ``x o y``
    (operands in the order the problem writes them) and ``z`` is its value; each operation is evaluated once;
(d) verification format: ``problem, steps so far (each closed by the delimiter), VERIFY_SUFFIX`` then one judge word,
    ``Correct`` or ``Incorrect`` (one token each).

Grading rules, precisely:

- ``steps(text)``: the symbols of ``text`` before the first ``answer`` mark, split on ``;``; an empty last segment (text
  that ends with the delimiter) is dropped, other segments are kept as written (an empty or malformed one grades wrong).
- ``grade_steps(prompt, text)``: one bool per step. Step k is graded against the problem and the *correct* steps
  before it (a wrong step evaluates nothing, so a later step that uses its result is wrong too). Where the problem
  has identical sub-expressions, every way of matching the earlier steps is tried.
- ``final_answer(text)``: the first symbol after the first ``answer`` mark (None when there is none), cut to its
  leading digits when it has any; everything after it (EOS, padding, junk, a second answer) is ignored.
  ``grade(prompt, text)`` is True iff that is the problem's value (``"answer 12"`` is not ``2``). ``grade``
  looks at the final answer only, not at the steps. ``text`` is the generated continuation, without the prompt.

Difficulty is set by ``TaskConfig``: the expression shapes (more leaves = more steps and more orders), the operators
and the modulus. Measured on the 2-core CPU (design.md §6): ``(x o x) o (x o x)`` mod 10 with ``+ - *`` (the default)
reached 72% with a 1.3M model in 7 minutes with the loss still falling, while 2-digit +/- was far too hard.
"""

from __future__ import annotations

import operator
import random
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from parse_jax.errors import ConfigError, InputError
from parse_jax.settings import DELIMITER, JUDGE_NO, JUDGE_YES, VERIFY_SUFFIX  # the verification format
from parse_jax.tasks.expressions import (
    ANSWER_MARK,
    EQUALS,
    OPS,
    PROMPT_END,
    SYMBOLS,
    Problem,
    apply_op,
    as_rng,
    parse_prompt,
    parse_shape,
    render_solution,
    render_step,
)

CORRUPTIONS = ("result", "operand", "operator", "subexpr")



SPLITS = ("test", "train", "all")



@dataclass(frozen=True)
class TaskConfig:
    """The difficulty knobs.

    shapes: expression templates, one drawn uniformly per problem; ``x`` is a digit, ``o`` an operator, every
        operation but the outermost in parentheses. Steps per problem = number of ``o``; the number of correct step
        orders grows with the number of independent sub-expressions.
    ops: operators drawn uniformly for each ``o`` (any of ``+ - *``).
    modulus: digits are ``0 .. modulus-1`` and every result is reduced modulo it (2..10, single digits).
    heldout_fraction: share of all problems reserved for evaluation (``split="test"``), by a hash of the prompt.
    """

    shapes: tuple[str, ...] = ("(x o x) o (x o x)",)
    ops: tuple[str, ...] = ("+", "-", "*")
    modulus: int = 10
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(self.shapes))
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.shapes:
            raise ConfigError("TaskConfig.shapes is empty")
        for shape in self.shapes:
            parse_shape(shape)
        if not self.ops or len(set(self.ops)) != len(self.ops) or any(o not in OPS for o in self.ops):
            raise ConfigError(f"TaskConfig.ops must be distinct operators among {sorted(OPS)}, got {self.ops!r}")
        if not (isinstance(self.modulus, int) and 2 <= self.modulus <= 10):
            raise ConfigError(f"TaskConfig.modulus must be an int in 2..10 (single digits), got {self.modulus!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ConfigError(f"TaskConfig.heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")



class Task:
    """The embedded step-by-step task (see the module docstring for the format and the grading rules)."""

    DELIMITER = DELIMITER
    VERIFY_SUFFIX = VERIFY_SUFFIX
    JUDGE_YES = JUDGE_YES
    JUDGE_NO = JUDGE_NO
    ANSWER_MARK = ANSWER_MARK
    PROMPT_END = PROMPT_END
    CORRUPTIONS = CORRUPTIONS

    def __init__(self, config: TaskConfig | None = None, name: str = "custom") -> None:
        self.config = config if config is not None else TaskConfig()
        self.name = name
        self._shapes = [parse_shape(s) for s in self.config.shapes]

    def __repr__(self) -> str:
        return f"Task({self.name!r}, {self.config})"

    # -- problems ---------------------------------------------------------------------------------------------

    def parse(self, prompt: str) -> Problem:
        """The expression tree of `prompt` (InputError when it is not a problem of this task)."""
        return parse_prompt(prompt, self.config.modulus)

    def is_heldout(self, prompt: str) -> bool:
        """Whether `prompt` belongs to the evaluation split (a stable hash of the prompt text)."""
        return zlib.crc32(prompt.encode("utf-8")) % 10_000 < round(self.config.heldout_fraction * 10_000)

    def sample(self, rng: random.Random, split: str = "train") -> str:
        """One random prompt from `split` ("train", "test" or "all")."""
        if split not in SPLITS:
            raise InputError(f"split must be one of {SPLITS}, got {split!r}")
        for _ in range(100_000):
            toks = self._shapes[rng.randrange(len(self._shapes))]
            out = []
            for t in toks:
                if t == "x":
                    out.append(str(rng.randrange(self.config.modulus)))
                elif t == "o":
                    out.append(self.config.ops[rng.randrange(len(self.config.ops))])
                else:
                    out.append(t)
            prompt = " ".join(out) + " " + PROMPT_END
            if split == "all" or self.is_heldout(prompt) == (split == "test"):
                return prompt
        raise ConfigError(f"no problem of split {split!r} found: the task config {self.config} is too small")

    def problems(self, n: int, seed: int = 0, split: str = "test") -> list[tuple[str, str]]:
        """`n` (prompt, reference solution) pairs, deterministic per `seed`; the reference is the canonical solution
        (steps in left-to-right order, then the final answer). `split="test"` (the default) draws held-out
        problems only, `"train"` never does, `"all"` ignores the split. `problems(m, s)` is a prefix of
        `problems(n, s)` for m < n."""
        if not isinstance(n, int) or n < 0:
            raise InputError(f"n must be a non-negative int, got {n!r}")
        try:
            rng = random.Random(operator.index(seed))
        except TypeError:
            raise InputError(f"seed must be an int, got {seed!r}") from None
        prompts = [self.sample(rng, split) for _ in range(n)]
        return [(p, self.solve(p)) for p in prompts]

    def answer(self, prompt: str) -> str:
        """The final answer of `prompt` as text (one digit)."""
        return str(self.parse(prompt).value)

    # -- solutions --------------------------------------------------------------------------------------------

    def _render_order(self, prob: Problem, order: Sequence[int]) -> str:
        nodes = prob.nodes
        steps = [render_step(nodes[nodes[i].left].value, nodes[i].op, nodes[nodes[i].right].value, nodes[i].value)
                 for i in order]
        return render_solution(steps, prob.value)

    def solve(self, prompt: str, rng: Any = None) -> str:
        """A correct solution of `prompt`. Without `rng`, the canonical order (left-to-right post-order); with one,
        each step is drawn uniformly among the operations whose operands are known (so independent
        sub-expressions come in random order)."""
        prob = self.parse(prompt)
        rng = as_rng(rng)
        if rng is None:
            return self._render_order(prob, prob.order)
        done: set[int] = set()
        order: list[int] = []
        for _ in prob.order:
            ready = [i for i in prob.order if i not in done and self._ready(prob, i, done)]
            pick = ready[rng.randrange(len(ready))]
            done.add(pick)
            order.append(pick)
        return self._render_order(prob, order)

    @staticmethod
    def _ready(prob: Problem, i: int, done: set[int] | frozenset[int]) -> bool:
        n = prob.nodes[i]
        return all(prob.nodes[c].op is None or c in done for c in (n.left, n.right))

    def _orders(self, prob: Problem, limit: int) -> Iterator[tuple[int, ...]]:
        """Every valid step order (topological orders of the operation nodes), canonical first."""
        count = 0

        def rec(done: frozenset[int], order: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
            nonlocal count
            if len(order) == len(prob.order):
                count += 1
                yield order
                return
            for i in prob.order:
                if count >= limit:
                    return
                if i not in done and self._ready(prob, i, done):
                    yield from rec(done | {i}, (*order, i))

        yield from rec(frozenset(), ())

    def all_solutions(self, prompt: str, limit: int = 10_000) -> list[str]:
        """Every distinct correct solution text of `prompt` (at most `limit` step orders), canonical first."""
        prob = self.parse(prompt)
        texts = dict.fromkeys(self._render_order(prob, o) for o in self._orders(prob, limit))
        return list(texts)

    # -- parsing and grading generated text --------------------------------------------------------------------

    @staticmethod
    def steps(text: str) -> list[str]:
        """The steps of a solution (or solution prefix) `text`: symbols before the first answer mark, split on the
        delimiter; an empty last segment is dropped. Each step is returned with single spaces."""
        toks = text.split()
        if ANSWER_MARK in toks:
            toks = toks[: toks.index(ANSWER_MARK)]
        segments: list[list[str]] = [[]]
        for t in toks:
            if t == DELIMITER:
                segments.append([])
            else:
                segments[-1].append(t)
        if not segments[-1]:
            segments.pop()
        return [" ".join(s) for s in segments]

    @staticmethod
    def final_answer(text: str) -> str | None:
        """The final answer of `text`: the first symbol after the first answer mark (None when there is none), cut
        to its leading digits when it has any (so `"answer 7<eos>"` reads 7 but `"answer 12"` reads 12)."""
        toks = text.split()
        if ANSWER_MARK not in toks:
            return None
        k = toks.index(ANSWER_MARK)
        if k + 1 >= len(toks):
            return None
        digits = re.match(r"[0-9]*", toks[k + 1]).group()
        return digits or toks[k + 1]

    def grade(self, prompt: str, text: str) -> bool:
        """True iff the final answer of `text` (see `final_answer`) is the value of `prompt`'s expression."""
        if not isinstance(text, str):
            raise InputError(f"grade: text must be a string (the model's output), got {type(text).__name__}")
        return self.final_answer(text) == str(self.parse(prompt).value)

    def _parse_step(self, step: str) -> tuple[int, str, int, int] | None:
        t = step.split()
        digits = {str(d): d for d in range(self.config.modulus)}
        if len(t) != 5 or t[0] not in digits or t[1] not in OPS or t[2] not in digits or t[3] != EQUALS:
            return None
        if t[4] not in digits:
            return None
        return digits[t[0]], t[1], digits[t[2]], digits[t[4]]

    def _matches(self, prob: Problem, done: frozenset[int], step: tuple[int, str, int, int]) -> list[int]:
        """Operation nodes not in `done` that `step` evaluates correctly, given the nodes in `done`."""
        x, op, y, z = step
        out = []
        for i in prob.order:
            n = prob.nodes[i]
            if (i not in done and n.op == op and self._ready(prob, i, done) and prob.nodes[n.left].value == x
                    and prob.nodes[n.right].value == y and n.value == z):
                out.append(i)
        return out

    def _grade(self, prob: Problem, steps: Sequence[str]) -> tuple[list[bool], set[frozenset[int]]]:
        """Per-step correctness, and every set of evaluated nodes consistent with the correct steps."""
        states: set[frozenset[int]] = {frozenset()}
        marks = []
        for s in steps:
            parsed = self._parse_step(s)
            new: set[frozenset[int]] = set()
            if parsed is not None:
                for done in states:
                    new.update(done | {i} for i in self._matches(prob, done, parsed))
            marks.append(bool(new))
            if new:
                states = new
        return marks, states

    def grade_steps(self, prompt: str, text: str) -> list[bool]:
        """For each step of `text` (see `steps`): is it a correct operation given the problem and the correct steps
        before it? (Module docstring, rule (c).)"""
        return self._grade(self.parse(prompt), self.steps(text))[0]

    def prefix_correct(self, prompt: str, steps_so_far: Sequence[str], final_answer: str | None = None) -> bool:
        """The judge's label for a verification prompt: every step correct and, when a final answer is included,
        every operation evaluated and the answer right."""
        prob = self.parse(prompt)
        marks, states = self._grade(prob, steps_so_far)
        if not all(marks):
            return False
        if final_answer is None:
            return True
        complete = any(len(s) == prob.n_steps for s in states)
        return complete and str(final_answer).strip() == str(prob.value)

    # -- corruptions ------------------------------------------------------------------------------------------

    def _assignment(self, prob: Problem, steps: Sequence[str]) -> list[int]:
        """The operation node each step evaluates, for a fully correct solution (first consistent matching)."""
        parsed = [self._parse_step(s) for s in steps]

        def rec(k: int, done: frozenset[int]) -> list[int] | None:
            if k == len(parsed):
                return [] if len(done) == prob.n_steps else None
            if parsed[k] is None:
                return None
            for i in self._matches(prob, done, parsed[k]):
                rest = rec(k + 1, done | {i})
                if rest is not None:
                    return [i, *rest]
            return None

        out = rec(0, frozenset())
        if out is None:
            raise InputError("corrupt needs a complete correct solution of the prompt (every step graded correct)")
        return out

    def _candidates(self, prob: Problem, node: int, kind: str) -> list[tuple[int, str, int, int]]:
        """Wrong versions (x, op, y, z) of the step evaluating `node`, of one kind; z differs from the true value."""
        m = self.config.modulus
        nodes = prob.nodes
        n = nodes[node]
        x, y, z = nodes[n.left].value, nodes[n.right].value, n.value
        out: list[tuple[int, str, int, int]] = []
        if kind == "result":  # right operation, wrong arithmetic
            out = [(x, n.op, y, v) for v in range(m) if v != z]
        elif kind == "operand":  # one operand miscopied, then computed correctly
            out = [(d, n.op, y, apply_op(n.op, d, y, m)) for d in range(m) if d != x]
            out += [(x, n.op, d, apply_op(n.op, x, d, m)) for d in range(m) if d != y]
        elif kind == "operator":  # wrong operator, computed correctly
            out = [(x, o, y, apply_op(o, x, y, m)) for o in self.config.ops if o != n.op]
        elif kind == "subexpr":  # an operation the problem does not contain
            pairs: list[tuple[int, str, int]] = [(y, n.op, x)]  # swapped operands
            if nodes[n.right].op is not None:  # a raw digit instead of the right sub-expression's value
                pairs.append((x, n.op, nodes[n.right].first_leaf))
            if nodes[n.left].op is not None:  # a raw digit instead of the left sub-expression's value
                pairs.append((nodes[n.left].last_leaf, n.op, y))
            p = prob.parent[node]
            if p >= 0:  # digits across the parenthesis, with the enclosing operator
                par = nodes[p]
                if par.left == node:
                    pairs.append((n.last_leaf, par.op, nodes[par.right].first_leaf))
                else:
                    pairs.append((nodes[par.left].last_leaf, par.op, n.first_leaf))
            out = [(a, o, b, apply_op(o, a, b, m)) for a, o, b in pairs]
        else:
            raise InputError(f"corruption kind must be one of {CORRUPTIONS}, got {kind!r}")
        return [c for c in dict.fromkeys(out) if c[3] != z]

    def corrupt(self, prompt: str, solution: str, rng: Any = None, *, step: int | None = None,
                kind: str | None = None) -> tuple[str, int]:
        """`solution` (a complete correct solution, in any valid order) with one step made wrong, and that step's index.

        Kinds (`CORRUPTIONS`): "result" (wrong arithmetic), "operand" (one operand miscopied), "operator" (wrong
        operator), "subexpr" (an operation the problem does not contain: swapped operands, a raw digit in place
        of a sub-expression's value, digits across a parenthesis). The wrong step's value differs from the true
        one and later steps carry it forward as a solver would (each computed correctly from the values it has),
        so the final answer is usually wrong. Steps before the corrupted one are unchanged (correct).

        `step` fixes the corrupted index (default: uniform); `kind` fixes the kind (default: a random kind that is
        possible here; an explicit kind that is impossible raises InputError)."""
        prob = self.parse(prompt)
        steps = self.steps(solution)
        if not steps:
            raise InputError("the solution has no step to corrupt")
        assign = self._assignment(prob, steps)
        r = as_rng(rng) or random.Random(0)
        idx = r.randrange(len(steps)) if step is None else step
        if not 0 <= idx < len(steps):
            raise InputError(f"step {idx} out of range for a solution of {len(steps)} steps")
        if kind is None:
            kinds = list(CORRUPTIONS)
            r.shuffle(kinds)
        else:
            kinds = [kind]
        nodes = prob.nodes
        for k in kinds:
            cands = self._candidates(prob, assign[idx], k)
            r.shuffle(cands)
            for cand in cands:
                values = {i: n.value for i, n in enumerate(nodes) if n.op is None}
                out = []
                for j, i in enumerate(assign):
                    if j == idx:
                        out.append(render_step(*cand))
                        values[i] = cand[3]
                    else:
                        n = nodes[i]
                        xv, yv = values[n.left], values[n.right]
                        values[i] = apply_op(n.op, xv, yv, prob.modulus)
                        out.append(render_step(xv, n.op, yv, values[i]))
                text = render_solution(out, values[prob.root])
                marks = self.grade_steps(prompt, text)
                if not marks[idx] and all(marks[:idx]):
                    return text, idx
        raise InputError(f"no corruption of kind {kinds} is possible at step {idx} of {solution!r}")

    # -- verification format ----------------------------------------------------------------------------------

    def verify_prompt(self, prompt: str, steps_so_far: Sequence[str], final_answer: str | None = None) -> str:
        """`prompt`, the steps so far each closed by the delimiter (exactly the solution text up to a delimiter
        boundary), optionally the final answer, then `VERIFY_SUFFIX`. The judge word follows after a space."""
        parts = [prompt.strip()]
        parts += [f"{' '.join(s.split())} {DELIMITER}" for s in steps_so_far]
        if final_answer is not None:
            parts.append(f"{ANSWER_MARK} {final_answer}")
        return " ".join(parts) + VERIFY_SUFFIX

    @staticmethod
    def judge_word(correct: bool) -> str:
        return JUDGE_YES if correct else JUDGE_NO

    @staticmethod
    def vocabulary() -> tuple[str, ...]:
        """Every symbol a task of this family writes (independent of the config, so one tokenizer fits all)."""
        return SYMBOLS



PRESETS: dict[str, TaskConfig] = {
    # 3 steps, 2 orders: the measured shape (docs/design.md §6).
    "default": TaskConfig(),
    # Same shape, no multiplication: a gentler table to learn.
    "easy": TaskConfig(ops=("+", "-")),
    # 3 or 4 steps, 2 or 3 orders.
    "medium": TaskConfig(shapes=("(x o x) o (x o x)", "((x o x) o x) o (x o x)", "(x o x) o (x o (x o x))")),
    # 3 to 5 steps, up to 8 orders: three independent sub-expressions in the 6-leaf shapes.
    "hard": TaskConfig(shapes=("(x o x) o (x o x)", "((x o x) o x) o (x o x)",
                               "((x o x) o (x o x)) o (x o x)", "(x o x) o ((x o x) o (x o x))")),
}



def load_task(name: str = "default") -> Task:
    """The embedded task, by preset name (`PRESETS`: "default", "easy", "medium", "hard")."""
    if name not in PRESETS:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(PRESETS)}")
    return Task(PRESETS[name], name=name)
