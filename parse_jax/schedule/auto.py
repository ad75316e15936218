"""`schedule="auto"`: before each batch the engine asks whether its speculative mode will beat plain decoding at
this batch size, and runs plain decoding where it will not (vLLM's `speculative_disable_by_batch_size`, decided
from costs instead of a fixed size).

The estimate of a choice's seconds per token, best first:
1. measured: what that choice took per token at this batch bucket earlier in the engine's life;
2. predicted and calibrated: the cost model's prediction (`policy.decide`: profile or roofline, and the acceptance
   seen so far) scaled by measured / predicted of plain decoding at this bucket where it was measured, else of the
   median measured choice (the same hardware runs them all);
3. predicted: the cost model alone.
Speculation runs where its estimate beats plain decoding's by more than `SPECULATION_MARGIN` (measurement noise).
The choices are plain decoding and the mode, with each rounds setting the schedule may pick (`rounds="auto"`: multi
and single). Where more batches follow (`explore=True`), a bucket where nothing is measured yet runs its predicted
best on prompts of its own (measured, before it serves the rest: the engine serves an explored choice over
`EXPLORE_FILLS` x its slots of prompts, at least `EXPLORE_MIN_PROMPTS`, so that it is measured as served), and a
choice
not measured yet whose estimate is within `EXPLORE_RATIO` of the best measured one runs once, so that it becomes
measured (plain decoding, the baseline, whatever its estimate, once a speculative choice is measured); a single batch
never explores.
One timed batch is not enough to tell choices 10-20% apart on a shared machine, so a figure is the median of its last
`KEEP` measurements, and a choice that is contested (within `CONTESTED` of the pick, after the margin) is measured
again, at most once per call, until it has `CONFIRM` of them: what decides a close call is several measurements of
each side, taken at different moments. Measuring again costs its window at the contested choice's price, so it runs
only where the work that follows can pay that back (`worth_measuring`: the expected improvement of the pick, with
`NOISE` per measurement, over the windows of work left in the call or job, against the window's expected loss).
Everything here is host-side bookkeeping between device programs; nothing runs under jit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Mapping
from typing import Any

from parse_jax.runtime.programs import bucket
from parse_jax.schedule.costs import PassCosts
from parse_jax.schedule.policy import AcceptanceStats, Knobs, Workload, decide

EXPLORE_RATIO = 2.0  # explore the unmeasured choice when predicted within this factor of the measured one
KEEP = 5             # measurements kept per choice and batch bucket; its figure is their median
EXPLORE_FILLS = 3    # an explored choice that serves runs this many times its slots of prompts (refilled)
# and at least this many prompts: a window measures the prompts it holds as much as the choice, and at one slot 3
# prompts can be the few the draft gets wrong (multi-round PARSE read 2.43 ms per token on three such prompts of the
# embedded pair, 0.56-0.85 on other windows of 3, plain decoding 2.4: plain decoding was served)
EXPLORE_MIN_PROMPTS = 8
CONFIRM = 3          # measurements of each contested choice before a close decision stands
CONTESTED = 0.4      # a choice whose cost is within this fraction of the pick's (after the margin) is contested
NOISE = 0.15  # the spread of one measurement, in log terms: the 0.85-1.15x of SPECULATION_MARGIN's comment
# speculation runs only where its estimate beats plain decoding's by this fraction: one timed batch on a shared
# machine varies by about as much (target against target, batch 4-16 on the 2-core CPU: 0.85-1.15x), and a gain
# inside that noise is as likely a loss (docs/design.md §7)
SPECULATION_MARGIN = 0.1
PLAIN = "target"
EXPLORING = "exploring (not measured at this batch yet)"  # the `why` of an explored batch


def option(run: str, rounds: str | None = None) -> str:
    """The name a choice is measured under: its mode, with the rounds the schedule chose ("parse-single")."""
    return run if rounds is None else f"{run}-{rounds}"


@dataclasses.dataclass(frozen=True)
class SetupCharge:
    """Program setup charged to a one-off job (`ParseEngine.job`): `seconds` of setup (tracing, compiling, loading)
    each choice is still expected to cost at this batch bucket (`schedule.setup.SetupLedger.left`), spread over the
    `steps` (batch-wide decode steps) the job has left. A choice then costs `estimate + seconds / steps` per token."""

    seconds: Mapping[str, float]
    steps: float

    def per_token(self, choice: str) -> float:
        return self.seconds.get(choice, 0.0) / max(self.steps, 1.0)


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What follows the batch being decided: a one-off job's setup charge (None outside a job), and the work left
    after an explored window, in windows (inf: unbounded), that measuring a close call again must pay back."""

    charge: SetupCharge | None = None
    windows_after: float = math.inf


@dataclasses.dataclass(frozen=True)
class ScheduleChoice:
    """What a batch runs (`run`: the requested mode, or "target" for plain decoding; `rounds`: the rounds the
    schedule chose for it, None where the config's are kept) and why. The figures are keyed by `option` names."""

    run: str
    mode: str
    batch: int
    estimate: Mapping[str, float]     # seconds per token of each choice, as used
    predicted: Mapping[str, float]    # the cost model's
    measured: Mapping[str, float]     # earlier batches' at this bucket
    explored: bool = False
    rounds: str | None = None
    setup: Mapping[str, float] = dataclasses.field(default_factory=dict)  # seconds per token charged (a job's)

    @property
    def speculate(self) -> bool:
        return self.run != PLAIN

    @property
    def name(self) -> str:
        return option(self.run, self.rounds)

    def as_dict(self) -> dict[str, Any]:
        why = (EXPLORING if self.explored else
               "measured" if len(self.measured) == len(self.predicted) else
               "calibrated prediction" if self.measured else "prediction")
        return {"mode": self.mode, "ran": self.run, "rounds": self.rounds, "batch": self.batch, "why": why,
                "seconds_per_token": dict(self.estimate), "predicted_seconds_per_token": dict(self.predicted),
                "measured_seconds_per_token": dict(self.measured), "setup_seconds_per_token": dict(self.setup)}


@dataclasses.dataclass(frozen=True)
class ScheduleState:
    """What the engine has seen: acceptance counts (the policy's input) and measured seconds per token per
    (choice, batch bucket), of two kinds kept apart: `samples`, the last `KEEP` measurements of served runs, and
    `fixed_samples`, those of fixed batches (a call's last or only batch, a mode that does not serve);
    `measured` gives each key one figure in served terms.
    `this_call`: the keys measured since `new_call`. Replaced, never mutated."""

    acceptance: AcceptanceStats = AcceptanceStats()
    step_tokens: float = 12.0
    samples: Mapping[tuple[str, int], tuple[float, ...]] = dataclasses.field(default_factory=dict)
    fixed_samples: Mapping[tuple[str, int], tuple[float, ...]] = dataclasses.field(default_factory=dict)
    this_call: frozenset[tuple[str, int]] = frozenset()

    @property
    def served(self) -> frozenset[tuple[str, int]]:
        """The keys measured in served runs."""
        return frozenset(self.samples)

    @functools.cached_property
    def measured(self) -> Mapping[tuple[str, int], float]:
        """Each (choice, batch bucket)'s figure in served terms: the median of its served samples; for a choice only
        measured in fixed batches, the median of those times what serving costs against a fixed batch for the choices
        of its bucket measured both ways (the median ratio), or as it stands where nothing at its bucket was served.
        Where something was served but no choice both ways, it has no figure (so it is explored again, served).

        The two kinds are not comparable as they stand: a short fixed batch carries its prefill, the call's overhead
        and its slowest row (the embedded pair at batch 4: plain decoding 7.1 ms per token-row in a fixed batch, 3.4
        served; single-round PARSE 4.0 and 2.5), so a choice once served would look cheaper than every choice only
        measured in fixed batches, whatever they cost. Another choice's ratio is itself off (2.1 against 1.6 there),
        but only until the choice is served and measured so."""
        served_figures = {key: statistics.median(values) for key, values in self.samples.items()}
        fixed_figures = {key: statistics.median(values) for key, values in self.fixed_samples.items()}
        ratios: dict[int, list[float]] = {}
        for (choice, b), figure in served_figures.items():
            if (choice, b) in fixed_figures:
                ratios.setdefault(b, []).append(figure / fixed_figures[(choice, b)])
        scale = {b: statistics.median(r) for b, r in ratios.items()}
        served_buckets = {b for _, b in served_figures}
        out = dict(served_figures)
        for (choice, b), figure in fixed_figures.items():
            if (choice, b) not in out and (b in scale or b not in served_buckets):
                out[(choice, b)] = figure * scale.get(b, 1.0)
        return out

    def new_call(self) -> ScheduleState:
        """This state at the start of a generate call (its choices may be measured again)."""
        return dataclasses.replace(self, this_call=frozenset())

    def count(self, choice: str, batch: int) -> int:
        """How many measurements the figure of `choice` at `batch`'s bucket is the median of (its served ones where
        it has any)."""
        key = (choice, bucket(batch, 1))
        return len(self.samples.get(key, ()) or self.fixed_samples.get(key, ()))

    def record(self, run: str, batch: int, stats: Mapping[str, Any], *, longest: int | None = None) -> ScheduleState:
        """This state with a finished batch's result counted in (`stats`: its GenerationStats dict). `longest`: the
        most tokens one row of a fixed batch wrote (rows that finish first idle until it ends); None for a served
        run, whose slots stay full. Each kind keeps its own last `KEEP` (see `measured`)."""
        tokens, seconds = stats.get("new_tokens", 0), stats.get("seconds", 0.0)
        samples, fixed_samples, this_call = dict(self.samples), dict(self.fixed_samples), self.this_call
        key, is_served = (run, bucket(batch, 1)), longest is None
        if tokens > 0 and seconds > 0:
            # seconds per token of one row with every row of the batch busy: what a served run keeps. A fixed batch
            # took `seconds` to write its longest row; counted by its mean row instead, its finished rows' idle
            # time would be charged to the choice
            per_token = seconds * batch / tokens if is_served else seconds / longest
            kind = samples if is_served else fixed_samples
            kind[key] = (*kind.get(key, ()), per_token)[-KEEP:]
            this_call = this_call | {key}
        acceptance, step_tokens = self.acceptance, self.step_tokens
        if run != PLAIN:
            counts = acceptance_counts(run, stats)
            acceptance = acceptance.update(**counts)
            if "steps_verified" in counts:
                step_tokens = mean_step_tokens(stats)
        return dataclasses.replace(self, acceptance=acceptance, step_tokens=step_tokens, samples=samples,
                                   fixed_samples=fixed_samples, this_call=this_call)


def mean_step_tokens(stats: Mapping[str, Any]) -> float:
    """Tokens per drafted step of a PARSE run's stats (at least 1)."""
    return max(1.0, stats["draft_tokens"] / max(sum(stats["prefixes_per_request"]), 1))


def acceptance_counts(run: str, stats: Mapping[str, Any]) -> dict[str, int]:
    """The counts (`AcceptanceStats.update`) a finished run of choice `run` adds: per kind of draft, what the target
    judged (the accepted ones and one rejection per draft that had one: nothing past a rejection is judged) and
    accepted, so that accepted / judged estimates the per-token (per-step) rate the policy's geometric models take.
    Rejections are counted per request, never per batch pass: a pass over B rows judges B drafts.
    - PARSE (`prefixes_per_request` in the stats): steps, from the accepted tokens over the mean step length; its
      rejections are the verifications whose first-rejected-step histogram is not in the last (none rejected) bin,
      else one per request's verification (`request_checks`). parse+eagle3 adds its continuation's EAGLE-3 drafts:
      one rejection at most per draft (`eagle3_num_drafts`).
    - Token-level (sd, or the head's with `run` "eagle3"): one rejection per draft less the drafts whose every
      position was accepted (the last of `num_accepted_tokens_per_pos`)."""
    drafted, accepted = stats.get("draft_tokens"), stats.get("accepted_tokens")
    if not drafted or accepted is None:
        return {}
    prefixes = stats.get("prefixes_per_request")
    if prefixes and "verify_passes" in stats:
        steps = max(sum(prefixes), 1)
        done = min(round(accepted / mean_step_tokens(stats)), steps)
        hist = stats.get("first_rejected_step_hist")
        rejected = (stats["num_verifications"] - hist[-1] if hist and "num_verifications" in stats
                    else stats.get("request_checks", stats["verify_passes"]))
        counts = {"steps_verified": min(steps, done + int(rejected)), "steps_accepted": done}
        e_drafted, e_accepted = stats.get("eagle3_draft_tokens"), stats.get("eagle3_accepted_tokens")
        if e_drafted and e_accepted is not None:
            judged, e_accepted = _judged(e_drafted, e_accepted, stats.get("eagle3_num_drafts"))
            counts.update(eagle3_drafted=judged, eagle3_accepted=e_accepted)
        return counts
    per_pos, drafts = stats.get("num_accepted_tokens_per_pos"), stats.get("num_drafts")
    judged, accepted = _judged(drafted, accepted, drafts - per_pos[-1] if per_pos and drafts is not None else None)
    return ({"eagle3_drafted": judged, "eagle3_accepted": accepted} if run == "eagle3"
            else {"drafted": judged, "accepted": accepted})


def _judged(drafted: int, accepted: int, rejected: int | None) -> tuple[int, int]:
    """(judged, accepted) tokens of drafts: the accepted ones and the `rejected` (None: every one not accepted), at
    most what was drafted."""
    accepted = min(int(accepted), int(drafted))
    return min(int(drafted), accepted + int(drafted - accepted if rejected is None else rejected)), accepted


def worth_measuring(gap: float, counts: tuple[int, int], windows_after: float) -> bool:
    """Whether measuring a contested choice again pays: its figure reads `gap` (log of its cost over the pick's,
    > 0) from `counts` measurements (its own, the pick's), each off by `NOISE`; measuring it costs one window at that
    gap, and if it is truly the cheaper one, the `windows_after` windows of work that follow run at its price
    instead. Expected improvement of a normal belief (`se` phi(z) - gap Phi(-z), z = gap / se) times the windows
    after, against the gap: a near tie is measured again where any work follows; a choice 30% behind, only before
    about 24 windows."""
    if math.isinf(windows_after):
        return True
    se = NOISE * math.sqrt(1.0 / max(counts[0], 1) + 1.0 / max(counts[1], 1))
    z = gap / se
    improvement = se * math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) - gap * 0.5 * math.erfc(z / math.sqrt(2.0))
    return improvement * windows_after >= gap


def choose(state: ScheduleState, costs: PassCosts, *, mode: str, knobs: Knobs, workload: Workload,
           rounds: tuple[str | None, ...] = (None,), explore: bool = False,
           outlook: Outlook = Outlook()) -> ScheduleChoice:
    """Plain decoding or `mode` for the next batch (`workload.batch` rows; its step length is replaced by the one
    measured so far), `mode` with each of `rounds` ("multi", "single"; None: `knobs.rounds`, the config's). See the
    module docstring. `outlook.charge`: a one-off job's setup costs, added to each choice's estimate; a choice that
    must pay setup is explored only where it then beats the best measured choice. `outlook.windows_after`: what a
    close call's measurement must pay back (`worth_measuring`)."""
    charge = outlook.charge
    batch = workload.batch
    if mode == PLAIN:
        return ScheduleChoice(PLAIN, mode, batch, {}, {}, {})
    workload = dataclasses.replace(workload, step_tokens=state.step_tokens)
    policy_mode = "parse" if mode == "sequential" else mode  # sequential: priced as PARSE (the same draft, more passes)

    def predict(acceptance: AcceptanceStats) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in rounds:
            decision = decide(costs, workload, acceptance,
                              dataclasses.replace(knobs, mode=policy_mode, rounds=r or knobs.rounds))
            by_mode = {c.mode: c.seconds_per_token for c in decision.alternatives}
            out[option(mode, r)] = by_mode[policy_mode]
            out[PLAIN] = by_mode[PLAIN]
        return out

    by_name = {option(mode, r): r for r in rounds}  # each speculative choice's rounds
    predicted = predict(state.acceptance)
    b = bucket(batch, 1)
    measured = {m: state.measured[(m, b)] for m in predicted if (m, b) in state.measured}
    estimate = dict(predicted)
    if measured:  # the unmeasured scaled as the measured ones err (the same hardware runs them all)
        # a measured run is set against its prediction at the acceptance seen, not the prior's: a draft that was
        # never accepted makes the prior's prediction of it too fast by the acceptance alone, and that error scaled
        # onto plain decoding's estimate would make plain decoding look as slow as the run that lost to it
        if PLAIN in measured:
            scale = measured[PLAIN] / predicted[PLAIN]
        else:
            as_seen = predict(state.acceptance.as_seen())
            ratios = sorted(measured[m] / as_seen[m] for m in measured)
            scale = ratios[len(ratios) // 2]
        # an unmeasured speculative choice (the other rounds) keeps the prior-blended prediction: nothing of it was
        # seen, and a few judged steps of another choice should not price it as if they were many
        estimate = {m: measured.get(m, predicted[m] * scale) for m in predicted}
    setup = {m: charge.per_token(m) for m in estimate if charge.per_token(m) > 0} if charge is not None else {}
    cost = {m: estimate[m] + setup.get(m, 0.0) for m in estimate}
    # plain decoding's cost less the margin: speculation must beat it by more than the noise
    judged = {m: cost[m] * (1.0 - SPECULATION_MARGIN if m == PLAIN else 1.0) for m in cost}
    pick = min(judged, key=lambda m: (judged[m], m != PLAIN))
    explored = False
    unmeasured = [m for m in sorted(cost, key=cost.get) if m not in measured]
    if explore and unmeasured:
        best = min((cost[m] for m in measured), default=None)
        if best is None:  # nothing measured here yet: the predicted best runs on prompts of its own, measured
            explored = True
        elif PLAIN in unmeasured and (PLAIN not in setup or cost[PLAIN] <= best):
            # a speculative choice is measured but plain decoding is not: measure the baseline before trusting a
            # win over it (its calibrated estimate borrows another choice's prediction error, which can be 2x)
            pick, explored = PLAIN, True
        else:
            near = [m for m in unmeasured if cost[m] <= (1.0 if m in setup else EXPLORE_RATIO) * best]
            if near:
                pick, explored = near[0], True
    if explore and not explored:  # a close call: measure the other side again until each has CONFIRM measurements
        contested = [m for m in sorted(cost, key=cost.get) if m != pick and m in measured and m not in setup
                     and judged[m] <= (1.0 + CONTESTED) * judged[pick] and state.count(m, batch) < CONFIRM
                     and (m, b) not in state.this_call
                     and worth_measuring(math.log(max(judged[m], 1e-12) / max(judged[pick], 1e-12)),
                                         (state.count(m, batch), max(state.count(pick, batch), 1)),
                                         outlook.windows_after)]
        if contested:
            pick, explored = min(contested, key=lambda m: state.count(m, batch)), True
    run, chosen = (PLAIN, None) if pick == PLAIN else (mode, by_name[pick])
    return ScheduleChoice(run, mode, batch, estimate, predicted, measured, explored, chosen, setup)
