"""Expression trees of the embedded task: the symbols it writes, problems parsed from their prompts, solutions
rendered one operation per step (the task's format is described in `parse_jax/tasks/arith.py`).
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from parse_jax.errors import ConfigError, InputError
from parse_jax.settings import DELIMITER, JUDGE_NO, JUDGE_YES  # the verification format
from parse_jax.utils.validation import shorten

ANSWER_MARK = "answer"



PROMPT_END = ":"



EQUALS = "="



OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}



# Every symbol any task of this family can write, in a fixed order (the tokenizer's vocabulary after the specials).
SYMBOLS: tuple[str, ...] = (
    *(str(d) for d in range(10)), *OPS, "(", ")", PROMPT_END, DELIMITER, EQUALS, "|", ANSWER_MARK, "check",
    JUDGE_YES, JUDGE_NO,
)



@dataclass(frozen=True)
class Node:
    """One node of a problem: a digit (``op is None``) or an operation on two child nodes (ids into ``nodes``)."""

    op: str | None
    left: int
    right: int
    value: int
    first_leaf: int  # value of the leftmost digit under this node
    last_leaf: int  # value of the rightmost digit under this node



@dataclass(frozen=True)
class Problem:
    """A parsed prompt. ``order`` lists the operation nodes in canonical (left-to-right post-order) order."""

    prompt: str
    nodes: tuple[Node, ...]
    root: int
    order: tuple[int, ...]
    parent: tuple[int, ...] = field(repr=False)  # -1 for the root
    modulus: int

    @property
    def value(self) -> int:
        return self.nodes[self.root].value

    @property
    def n_steps(self) -> int:
        return len(self.order)



def apply_op(op: str, x: int, y: int, modulus: int) -> int:
    return OPS[op](x, y) % modulus



def parse_shape(shape: str) -> list[str]:
    if not isinstance(shape, str) or re.fullmatch(r"[()xo\s]*", shape) is None:
        raise ConfigError(f"shape {shape!r} may only use x (a digit), o (an operator), parentheses and spaces")
    toks = re.findall(r"[()xo]", shape)
    # The same grammar as problems: substitute a digit and an operator and parse.
    try:
        parse_tokens([{"x": "1", "o": "+"}.get(t, t) for t in toks], 10, shape)
    except InputError as e:
        raise ConfigError(f"bad shape {shape!r}: {e}") from None
    if "o" not in toks:
        raise ConfigError(f"shape {shape!r} has no operation")
    return toks



def parse_tokens(toks: Sequence[str], modulus: int, source: str) -> tuple[list[Node], int, list[int]]:
    """Recursive descent over ``expr := atom [op atom]``, ``atom := digit | ( atom op atom )``.

    Returns (nodes, root id, canonical order of operation nodes)."""
    nodes: list[Node] = []
    order: list[int] = []
    digits = {str(d): d for d in range(modulus)}
    pos = 0

    def fail(msg: str) -> InputError:
        return InputError(f"not a problem of this task ({msg} at symbol {pos}): {shorten(repr(source))}")

    def atom() -> int:
        nonlocal pos
        if pos >= len(toks):
            raise fail("unexpected end")
        t = toks[pos]
        if t in digits:
            pos += 1
            nodes.append(Node(None, -1, -1, digits[t], digits[t], digits[t]))
            return len(nodes) - 1
        if t == "(":
            pos += 1
            left = atom()
            node = binary(left, required=True)
            if pos >= len(toks) or toks[pos] != ")":
                raise fail("expected ')'")
            pos += 1
            return node
        raise fail(f"unexpected {t!r}")

    def binary(left: int, required: bool) -> int:
        nonlocal pos
        if pos >= len(toks) or toks[pos] not in OPS:
            if required:
                raise fail("expected an operator")
            return left
        op = toks[pos]
        pos += 1
        right = atom()
        a, b = nodes[left], nodes[right]
        nodes.append(Node(op, left, right, apply_op(op, a.value, b.value, modulus), a.first_leaf, b.last_leaf))
        order.append(len(nodes) - 1)
        return len(nodes) - 1

    root = binary(atom(), required=False)
    if pos != len(toks):
        raise fail("trailing symbols")
    return nodes, root, order



@lru_cache(maxsize=1 << 16)
def parse_prompt(prompt: str, modulus: int) -> Problem:
    if not isinstance(prompt, str):
        raise InputError(f"a prompt must be a str, got {type(prompt).__name__}")
    toks = prompt.split()
    if not toks or toks[-1] != PROMPT_END:
        raise InputError(f"not a problem of this task (a prompt ends with {PROMPT_END!r}): {shorten(repr(prompt))}")
    nodes, root, order = parse_tokens(toks[:-1], modulus, prompt)
    parent = [-1] * len(nodes)
    for i, n in enumerate(nodes):
        if n.op is not None:
            parent[n.left] = parent[n.right] = i
    return Problem(prompt, tuple(nodes), root, tuple(order), tuple(parent), modulus)



def render_expr(nodes: Sequence[Node], i: int, top: bool = True) -> str:
    n = nodes[i]
    if n.op is None:
        return str(n.value)
    body = f"{render_expr(nodes, n.left, False)} {n.op} {render_expr(nodes, n.right, False)}"
    return body if top else f"( {body} )"



def render_step(x: int, op: str, y: int, z: int) -> str:
    return f"{x} {op} {y} {EQUALS} {z}"



def render_solution(steps: Sequence[str], answer: int | str) -> str:
    return " ".join(f"{s} {DELIMITER}" for s in steps) + (" " if steps else "") + f"{ANSWER_MARK} {answer}"



def as_rng(rng: Any) -> random.Random | None:
    """None, an int seed, a `random.Random`, or a numpy Generator (one seed is drawn from it)."""
    if rng is None or isinstance(rng, random.Random):
        return rng
    if isinstance(rng, int) and not isinstance(rng, bool):
        return random.Random(rng)
    if hasattr(rng, "integers"):  # numpy.random.Generator
        return random.Random(int(rng.integers(0, 2**63 - 1)))
    raise InputError(f"rng must be None, an int, a random.Random or a numpy Generator, got {type(rng).__name__}")
