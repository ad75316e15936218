"""`schedule="auto"`: before each batch the engine asks whether its speculative mode will beat plain decoding at
this batch size, and runs plain decoding where it will not (vLLM's `speculative_disable_by_batch_size`, decided
from costs instead of a fixed size).

The estimate of a choice's seconds per token, best first:
1. measured: what that choice took per token at this batch bucket earlier in the engine's life;
2. predicted and calibrated: the cost model's prediction (`policy.decide`: profile or roofline, and the acceptance
   seen so far) scaled by measured / predicted of the other choice at this bucket (the same hardware runs both);
3. predicted: the cost model alone.
When only one choice is measured at a bucket and the other is predicted within `EXPLORE_RATIO` of it, the next batch
(`explore=True`: more batches follow) runs the other once, so both become measured; a single call never explores.
Everything here is host-side bookkeeping between device programs; nothing runs under jit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from parse_jax.runtime.programs import bucket
from parse_jax.schedule.costs import PassCosts
from parse_jax.schedule.policy import AcceptanceStats, Knobs, Workload, decide

EXPLORE_RATIO = 2.0  # explore the unmeasured choice when predicted within this factor of the measured one
EMA = 0.5            # weight of the newest measurement
PLAIN = "target"


@dataclasses.dataclass(frozen=True)
class ScheduleChoice:
    """What a batch runs (`run`: the requested mode, or "target" for plain decoding) and why."""

    run: str
    mode: str
    batch: int
    estimate: Mapping[str, float]     # seconds per token of each choice, as used
    predicted: Mapping[str, float]    # the cost model's
    measured: Mapping[str, float]     # earlier batches' at this bucket
    explored: bool = False

    @property
    def speculate(self) -> bool:
        return self.run != PLAIN

    def as_dict(self) -> dict[str, Any]:
        why = ("exploring (not measured at this batch yet)" if self.explored else
               "measured" if len(self.measured) == 2 else "calibrated prediction" if self.measured else "prediction")
        return {"mode": self.mode, "ran": self.run, "batch": self.batch, "why": why,
                "seconds_per_token": dict(self.estimate), "predicted_seconds_per_token": dict(self.predicted),
                "measured_seconds_per_token": dict(self.measured)}


@dataclasses.dataclass(frozen=True)
class ScheduleState:
    """What the engine has seen: acceptance counts (the policy's input) and measured seconds per token per
    (choice, batch bucket). Replaced, never mutated."""

    acceptance: AcceptanceStats = AcceptanceStats()
    measured: Mapping[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    step_tokens: float = 12.0

    def record(self, run: str, batch: int, stats: Mapping[str, Any], *, longest: int | None = None) -> ScheduleState:
        """This state with a finished batch's result counted in (`stats`: its GenerationStats dict). `longest`: the
        most tokens one row of a fixed batch wrote (rows that finish first idle until it ends); None for a served
        run, whose slots stay full."""
        tokens, seconds = stats.get("new_tokens", 0), stats.get("seconds", 0.0)
        measured = dict(self.measured)
        if tokens > 0 and seconds > 0:
            # seconds per token of one row with every row of the batch busy: what a served run keeps. A fixed batch
            # took `seconds` to write its longest row; counted by its mean row instead, its finished rows' idle
            # time would be charged to the choice (and a served choice would always look cheaper than an explored one)
            per_token = seconds / longest if longest else seconds * batch / tokens
            key = (run, bucket(batch, 1))
            old = measured.get(key)
            measured[key] = per_token if old is None else EMA * per_token + (1 - EMA) * old
        acceptance, step_tokens = self.acceptance, self.step_tokens
        drafted, accepted = stats.get("draft_tokens"), stats.get("accepted_tokens")
        prefixes = stats.get("prefixes_per_request")
        if run != PLAIN and drafted and accepted is not None and prefixes and "verify_passes" in stats:
            steps = max(sum(prefixes), 1)
            step_tokens = max(1.0, drafted / steps)
            done = round(accepted / step_tokens)
            judged = min(steps, done + int(stats["verify_passes"]))  # the accepted steps and each pass's rejection
            acceptance = acceptance.update(steps_verified=max(judged, done), steps_accepted=done)
        elif run != PLAIN and drafted and accepted is not None:
            acceptance = acceptance.update(drafted=int(drafted), accepted=min(int(accepted), int(drafted)))
        return dataclasses.replace(self, acceptance=acceptance, measured=measured, step_tokens=step_tokens)


def choose(state: ScheduleState, costs: PassCosts, *, mode: str, knobs: Knobs, workload: Workload,
           explore: bool = False) -> ScheduleChoice:
    """Plain decoding or `mode` for the next batch (`workload.batch` rows; its step length is replaced by the one
    measured so far, see the module docstring)."""
    batch = workload.batch
    if mode == PLAIN:
        return ScheduleChoice(PLAIN, mode, batch, {}, {}, {})
    workload = dataclasses.replace(workload, step_tokens=state.step_tokens)
    policy_mode = "parse" if mode == "sequential" else mode  # sequential: priced as PARSE (the same draft, more passes)
    rounds = "single" if policy_mode == "parse+eagle3" else knobs.rounds  # parse+eagle3 runs one round
    decision = decide(costs, workload, state.acceptance, dataclasses.replace(knobs, mode=policy_mode, rounds=rounds))
    by_mode = {c.mode: c.seconds_per_token for c in decision.alternatives}
    predicted = {mode: by_mode[policy_mode], PLAIN: by_mode[PLAIN]}
    b = bucket(batch, 1)
    measured = {m: state.measured[(m, b)] for m in predicted if (m, b) in state.measured}
    estimate = dict(predicted)
    if len(measured) == 1:
        (known, value), = measured.items()
        scale = value / predicted[known]
        estimate = {m: value if m == known else predicted[m] * scale for m in predicted}
    elif len(measured) == 2:
        estimate = dict(measured)
    run = min(estimate, key=lambda m: (estimate[m], m != PLAIN))  # a tie goes to plain decoding
    explored = False
    if explore and len(measured) == 1:
        other = next(m for m in predicted if m not in measured)
        known = next(iter(measured))
        if estimate[other] <= EXPLORE_RATIO * estimate[known]:
            run, explored = other, True
    return ScheduleChoice(run, mode, batch, estimate, predicted, measured, explored)
