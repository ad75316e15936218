"""The speculation policy: per batch (and per round) whether to speculate, in which mode and how much, chosen to
maximise expected tokens per second = expected tokens committed per round / predicted round seconds, from a cost
model (`PassCosts`) and the acceptance seen so far (`AcceptanceStats`). Pure functions of frozen values.

The expected-tokens model (B rows still active, target cache of C slots; `t(n)`, `d(n)`, `e(n)`: seconds of one
target, draft or EAGLE-3 head pass of n tokens per row at batch B; L: mean tokens of one reasoning step; S: the
verification suffix; a: the probability a drafted step is accepted; alpha: that a drafted token is):

- target: 1 token per `t(1)`.
- sd with gamma g (EAGLE-3 chains alike, with `e` for `d`): the first rejection ends a round, so the accepted
  run is truncated geometric and the target adds one token of its own: tokens = (1 - alpha^(g+1)) / (1 - alpha),
  seconds = g d(1) + t(g + 1).
- PARSE, a draft of D tokens = n = max(1, round(D / L)) steps, K' = min(K, n) prefixes at the steps
  m_k = ceil(k n / K') (spread evenly, the full draft last). Prefix k holds when all its m_k steps are correct,
  probability a^m_k, and the accepted prefix is the longest whose predecessors all hold (earliest_error), so
  E[accepted tokens] = L * sum_k (m_k - m_(k-1)) a^m_k. Drafting costs D d(1); the verification block is
  D + K' S tokens (+1: the target's last token, multi round): t(D + K' S + 1).
  - multi round: then the target writes one step itself (L tokens) and the draft reads it (d(L)):
    tokens = E[accepted] + L, seconds = D d(1) + d(L) + t(D + K' S + 1) + L * (seconds per target token).
  - single round (D capped at the N tokens still to write): the target writes the other N - E[accepted] tokens,
    tokens = N, seconds = D d(1) + t(D + K' S) + (N - E[accepted]) * (seconds per continuation token).
  - the target writes token by token (parse: t(1) per token) or with EAGLE-3 chains (parse+eagle3: the eagle3
    seconds per token, in its multi-round step as in its single-round rest).

Prompt prefill is common to every mode and left out. Knobs the user set (`Knobs`) are never changed: the policy only
chooses the ones left None, and a fixed mode is kept even where another would be faster.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, Literal

from parse_jax.errors import ConfigError
from parse_jax.schedule.costs import PassCosts
from parse_jax.settings import ParseConfig, Rounds
from parse_jax.utils.validation import check_choice, check_float, check_int

Mode = Literal["target", "sd", "eagle3", "parse", "parse+eagle3"]
MODES: tuple[str, ...] = ("target", "sd", "eagle3", "parse", "parse+eagle3")
DRAFT_TOKENS: tuple[int, ...] = (8, 16, 32, 64, 128)  # draft budgets tried when the user left it free
PREFIXES: tuple[int, ...] = (1, 2, 4, 8, 16)
GAMMAS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
ROUND_CHOICES: tuple[str, ...] = ("multi", "single")
# ParseConfig's flat setting names -> the knob they fix
SETTING_KNOBS = {"max_draft_tokens": "draft_tokens", "max_prefixes": "prefixes", "rounds": "rounds",
                 "gamma": "gamma", "eagle3_gamma": "eagle3_gamma"}


SEEN_WEIGHT = 1e-6  # the prior's weight in `AcceptanceStats.as_seen`: it decides only where nothing was judged


@dataclasses.dataclass(frozen=True)
class Prior:
    """Acceptance assumed before any is seen, worth `weight` observations (it fades as counts grow)."""

    token_rate: float = 0.6   # a draft-model token accepted (sd)
    eagle3_rate: float = 0.6  # an EAGLE-3 token accepted
    step_rate: float = 0.7    # a drafted step accepted by the judge (PARSE)
    weight: float = 8.0

    def __post_init__(self) -> None:
        for name in ("token_rate", "eagle3_rate", "step_rate"):
            check_float(f"prior {name}", getattr(self, name), 0.0, 1.0)
        check_float("prior weight", self.weight, 0.0, min_open=True)


@dataclasses.dataclass(frozen=True)
class AcceptanceStats:
    """Running counts, pooled over rows (`pooled` adds per-row ones). `drafted` / `eagle3_drafted` /
    `steps_verified` count what the target judged: the accepted ones and the first rejected one of each round
    (what follows a rejection is never judged), so accepted / judged estimates the per-token (per-step) rate."""

    drafted: int = 0
    accepted: int = 0
    eagle3_drafted: int = 0
    eagle3_accepted: int = 0
    steps_verified: int = 0
    steps_accepted: int = 0
    prior: Prior = Prior()

    def __post_init__(self) -> None:
        for judged, hits in (("drafted", "accepted"), ("eagle3_drafted", "eagle3_accepted"),
                             ("steps_verified", "steps_accepted")):
            n = check_int(judged, getattr(self, judged), 0)
            check_int(hits, getattr(self, hits), 0, n)

    def _rate(self, hits: int, judged: int, prior: float) -> float:
        return (hits + prior * self.prior.weight) / (judged + self.prior.weight)

    @property
    def token_rate(self) -> float:
        return self._rate(self.accepted, self.drafted, self.prior.token_rate)

    @property
    def eagle3_rate(self) -> float:
        return self._rate(self.eagle3_accepted, self.eagle3_drafted, self.prior.eagle3_rate)

    @property
    def step_rate(self) -> float:
        return self._rate(self.steps_accepted, self.steps_verified, self.prior.step_rate)

    def as_seen(self) -> AcceptanceStats:
        """These counts with the prior's weight all but gone: each rate is what was seen where anything was judged
        (the prior only where nothing was). What a measured run's cost is predicted with, to tell the hardware's
        error from the acceptance's (`auto.choose`)."""
        return dataclasses.replace(self, prior=dataclasses.replace(self.prior, weight=SEEN_WEIGHT))

    def update(self, **counts: int) -> AcceptanceStats:
        """These counts plus `counts` (e.g. `update(steps_verified=3, steps_accepted=2)` after a round)."""
        unknown = sorted(set(counts) - set(_COUNTS))
        if unknown:
            raise ConfigError(f"unknown acceptance count(s) {', '.join(unknown)}; the counts are: {', '.join(_COUNTS)}")
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in counts.items()})

    @staticmethod
    def pooled(rows: Iterable[AcceptanceStats], prior: Prior = Prior()) -> AcceptanceStats:
        """The counts of several rows added up."""
        rows = list(rows)
        return AcceptanceStats(**{k: sum(getattr(r, k) for r in rows) for k in _COUNTS}, prior=prior)


_COUNTS = tuple(f.name for f in dataclasses.fields(AcceptanceStats) if f.name != "prior")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the next round looks like: `batch` rows still active, the target's cache buffer (`cache_len` slots,
    what every pass reads), the draft's (`draft_cache_len`, default the same), mean tokens per reasoning step,
    suffix tokens per prefix, tokens still to write per row."""

    batch: int
    cache_len: int
    step_tokens: float = 12.0
    suffix_tokens: int = 4
    remaining_tokens: int = 256
    draft_cache_len: int | None = None

    def __post_init__(self) -> None:
        check_int("batch", self.batch, 1)
        check_int("cache_len", self.cache_len, 1)
        check_float("step_tokens", self.step_tokens, 1.0)
        check_int("suffix_tokens", self.suffix_tokens, 1)
        check_int("remaining_tokens", self.remaining_tokens, 1)
        if self.draft_cache_len is not None:
            check_int("draft_cache_len", self.draft_cache_len, 1)


@dataclasses.dataclass(frozen=True)
class Knobs:
    """What the user set explicitly (kept as given) versus left to the policy (None)."""

    mode: Mode | None = None
    draft_tokens: int | None = None
    prefixes: int | None = None
    rounds: Rounds | None = None
    gamma: int | None = None
    eagle3_gamma: int | None = None

    def __post_init__(self) -> None:
        if self.mode is not None:
            check_choice("mode", self.mode, MODES)
        if self.rounds is not None:
            check_choice("rounds", self.rounds, ROUND_CHOICES)
        for name, top in (("draft_tokens", 4096), ("prefixes", 256), ("gamma", 64), ("eagle3_gamma", 64)):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, top)

    @classmethod
    def from_settings(cls, cfg: ParseConfig, fixed: Iterable[str], mode: str = "auto") -> Knobs:
        """The knobs of `cfg` whose flat setting names are in `fixed` (what the user gave: `max_draft_tokens`,
        `max_prefixes`, `rounds`, `gamma`, `eagle3_gamma`), and the mode unless it is "auto"."""
        fixed = set(fixed)
        unknown = sorted(fixed - set(SETTING_KNOBS))
        if unknown:
            raise ConfigError(f"setting(s) {', '.join(unknown)} are no policy knobs; the knobs are: "
                              f"{', '.join(SETTING_KNOBS)}")
        flat = cfg.flat()
        return cls(mode=None if mode == "auto" else mode,
                   **{knob: flat[name] for name, knob in SETTING_KNOBS.items() if name in fixed})

    @property
    def fixed(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One alternative and its prediction. Knobs a mode does not use are 0 / None; `prefixes` is the setting (at
    most that many; a draft of fewer steps verifies one per step)."""

    mode: Mode
    tokens_per_round: float
    round_seconds: float
    draft_tokens: int = 0
    prefixes: int = 0
    rounds: Rounds | None = None
    gamma: int = 0

    @property
    def seconds_per_token(self) -> float:
        return self.round_seconds / self.tokens_per_round

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds_per_token": self.seconds_per_token}


@dataclasses.dataclass(frozen=True)
class Decision:
    """The choice and why: the best alternative of every mode considered (fastest first), with their predicted
    seconds per token, and the knobs that were the user's."""

    choice: Choice
    alternatives: tuple[Choice, ...]
    fixed: tuple[str, ...] = ()

    @property
    def speculate(self) -> bool:
        return self.choice.mode != "target"

    @property
    def reason(self) -> str:
        parts = ", ".join(f"{c.mode} {c.seconds_per_token * 1e3:.3g}" for c in self.alternatives)
        fixed = f" (fixed by the user: {', '.join(self.fixed)})" if self.fixed else ""
        return f"{self.choice.mode}: predicted ms/token {parts}{fixed}"

    def as_dict(self) -> dict[str, Any]:
        return {"choice": self.choice.as_dict(), "speculate": self.speculate, "reason": self.reason,
                "fixed": list(self.fixed),
                "seconds_per_token": {c.mode: c.seconds_per_token for c in self.alternatives}}


def expected_accepted_tokens(step_rate: float, draft_steps: int, prefixes: int, step_tokens: float) -> float:
    """E[accepted tokens] of a draft of `draft_steps` steps verified at `prefixes` evenly spread prefixes (see the
    module docstring)."""
    k = max(1, min(prefixes, draft_steps))
    marks = [math.ceil(i * draft_steps / k) for i in range(k + 1)]
    return step_tokens * sum((marks[i] - marks[i - 1]) * step_rate ** marks[i] for i in range(1, k + 1))


def expected_chain_tokens(rate: float, gamma: int) -> float:
    """Tokens a round of token-level speculation commits: the accepted run of `gamma` plus the target's own."""
    return gamma + 1.0 if rate >= 1.0 else (1.0 - rate ** (gamma + 1)) / (1.0 - rate)


def target_choice(costs: PassCosts, w: Workload) -> Choice:
    return Choice("target", 1.0, costs.seconds("target", w.batch, 1, w.cache_len))


def chain_choice(costs: PassCosts, w: Workload, rate: float, gamma: int, eagle3: bool = False) -> Choice:
    """A round of sd (the draft model) or of EAGLE-3 (`eagle3`: the head drafts)."""
    drafter, cache = ("eagle3", w.cache_len) if eagle3 else ("draft", w.draft_cache_len or w.cache_len)
    seconds = (gamma * costs.seconds(drafter, w.batch, 1, cache)
               + costs.seconds("target", w.batch, gamma + 1, w.cache_len))
    return Choice("eagle3" if eagle3 else "sd", expected_chain_tokens(rate, gamma), seconds, gamma=gamma)


def parse_choice(costs: PassCosts, w: Workload, step_rate: float, *, draft_tokens: int, prefixes: int,
                 rounds: Rounds, continuation: Choice | None = None) -> Choice:
    """A PARSE round (multi) or request (single); `continuation`: the EAGLE-3 choice the target writes with
    (parse+eagle3: its step in multi round, the rest in single round), else token by token."""
    b, c, dc = w.batch, w.cache_len, w.draft_cache_len or w.cache_len
    d = min(draft_tokens, w.remaining_tokens) if rounds == "single" else draft_tokens
    steps = max(1, round(d / w.step_tokens))
    k = max(1, min(prefixes, steps))
    accepted = min(expected_accepted_tokens(step_rate, steps, k, w.step_tokens), float(d))
    per_token = costs.seconds("target", b, 1, c) if continuation is None else continuation.seconds_per_token
    drafting = d * costs.seconds("draft", b, 1, dc)
    mode, gamma = ("parse", 0) if continuation is None else ("parse+eagle3", continuation.gamma)
    if rounds == "multi":
        block = d + k * w.suffix_tokens + 1
        seconds = (drafting + costs.seconds("draft", b, math.ceil(w.step_tokens), dc)
                   + costs.seconds("target", b, block, c) + w.step_tokens * per_token)
        return Choice(mode, accepted + w.step_tokens, seconds, d, prefixes, "multi", gamma)
    rest = w.remaining_tokens - accepted
    seconds = drafting + costs.seconds("target", b, d + k * w.suffix_tokens, c) + rest * per_token
    return Choice(mode, float(w.remaining_tokens), seconds, d, prefixes, "single", gamma)


def _options(fixed: Any, free: Iterable[Any]) -> tuple[Any, ...]:
    return (fixed,) if fixed is not None else tuple(free)


def _fastest(choices: Iterable[Choice]) -> Choice:
    return min(choices, key=lambda c: c.seconds_per_token)


def mode_choices(costs: PassCosts, w: Workload, stats: AcceptanceStats, knobs: Knobs, mode: str) -> Choice:
    """The best setting of the free knobs for `mode`."""
    if mode == "target":
        return target_choice(costs, w)
    eagle3 = None
    if mode in ("eagle3", "parse+eagle3"):
        eagle3 = _fastest(chain_choice(costs, w, stats.eagle3_rate, g, eagle3=True)
                          for g in _options(knobs.eagle3_gamma, GAMMAS))
        if mode == "eagle3":
            return eagle3
    if mode == "sd":
        return _fastest(chain_choice(costs, w, stats.token_rate, g) for g in _options(knobs.gamma, GAMMAS))
    rounds = _options(knobs.rounds, ROUND_CHOICES)
    return _fastest(parse_choice(costs, w, stats.step_rate, draft_tokens=d, prefixes=k, rounds=r,
                                 continuation=eagle3)
                    for d in _options(knobs.draft_tokens, DRAFT_TOKENS)
                    for k in _options(knobs.prefixes, PREFIXES) for r in rounds)


def available_modes(costs: PassCosts) -> tuple[str, ...]:
    """The modes the cost model can price: sd and parse need a draft, eagle3 a head."""
    needs = {"target": (), "sd": ("draft",), "eagle3": ("eagle3",), "parse": ("draft",),
             "parse+eagle3": ("draft", "eagle3")}
    return tuple(m for m in MODES if all(getattr(costs, r) is not None for r in needs[m]))


def decide(costs: PassCosts, workload: Workload, stats: AcceptanceStats = AcceptanceStats(),
           knobs: Knobs = Knobs()) -> Decision:
    """The fastest predicted alternative for the next round of `workload`: over every mode the cost model can price
    when `knobs.mode` is None ("auto"), else within the user's mode; free knobs searched, fixed ones kept."""
    modes = available_modes(costs)
    if knobs.mode is not None and knobs.mode not in modes:
        raise ConfigError(f"mode {knobs.mode!r} needs a cost for its "
                          f"{'draft' if costs.draft is None else 'EAGLE-3 head'}; this cost model prices: "
                          f"{', '.join(modes)}")
    considered = modes if knobs.mode is None else tuple(dict.fromkeys((knobs.mode, "target")))
    best = {m: mode_choices(costs, workload, stats, knobs, m) for m in considered}
    choice = best[knobs.mode] if knobs.mode is not None else _fastest(best.values())
    ranked = tuple(sorted(best.values(), key=lambda c: c.seconds_per_token))
    return Decision(choice, ranked, knobs.fixed)
