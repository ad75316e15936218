"""What a mode reads: a typed, frozen `ModeContext` that `ParseEngine` builds once (the models, the settings, the
judge and the verification suffix), and `parse_result`, the result of a PARSE-family mode from its device counters."""

from __future__ import annotations

import dataclasses

import numpy as np

from parse_jax.models.config import ModelConfig
from parse_jax.runtime.requests import GenerateResult, GenerationStats, Request
from parse_jax.settings import ParseConfig
from parse_jax.verify.round import Judge, RoundSpec


@dataclasses.dataclass(frozen=True, eq=False)
class ModeContext:
    """Everything a mode's `run(ctx, request)` may read, fixed when the engine is built: the target, the draft (None
    for the modes that need none), the target's EAGLE-3 head (None without one), the PARSE settings, the judge's
    traced inputs, the round's static settings, the verification suffix as ids (the judge words' shared first
    tokens included) and the ids that complete a step delimiter (where a multi-round target stops)."""

    target: object
    draft: object | None
    head: object | None
    config: ParseConfig
    judge: Judge
    round_spec: RoundSpec
    suffix_ids: tuple[int, ...]
    step_end_ids: np.ndarray


@dataclasses.dataclass(frozen=True)
class PairSpec:
    """The static side of the target/draft pair a program runs: their configs and attention implementations."""

    target: ModelConfig
    draft: ModelConfig
    target_impl: str
    draft_impl: str

    @classmethod
    def of(cls, ctx: ModeContext) -> PairSpec:
        return cls(ctx.target.config, ctx.draft.config, ctx.target.attention_impl, ctx.draft.attention_impl)


@dataclasses.dataclass(frozen=True)
class Launch:
    """A jitted program and the arguments of one call (its inputs placed as the target places rows): what a mode
    runs on the device for a request. `benchmarks/bench_host_share.py` times `program(*args)` alone."""

    program: object
    args: tuple


def step_metrics(rows: dict, n: int) -> dict:
    """PARSE's per-step metrics (parse_jax/runtime/metrics.py) of the first `n` rows' counters: steps drafted,
    passes by their first rejected step, the judge scores of accepted and rejected prefixes, verification passes
    (every pass a row was live in adds one count to its first-rejected histogram)."""
    if "rejected_at" not in rows:
        return {}
    rejected_at, hist = np.asarray(rows["rejected_at"][:n]), np.asarray(rows["score_hist"][:n])
    return {"num_steps_drafted": int(np.sum(rows["prefixes"][:n])), "num_verifications": int(rejected_at.sum()),
            "first_rejected_step_hist": [int(x) for x in rejected_at.sum(0)],
            "accepted_score_hist": [int(x) for x in hist[:, 0].sum(0)],
            "rejected_score_hist": [int(x) for x in hist[:, 1].sum(0)]}


def parse_result(ctx: ModeContext, req: Request, rows: dict, seconds: float, *, verify_passes: int,
                 target_passes: int, continue_batch: int | None = None, rounds: int | None = None) -> GenerateResult:
    """A PARSE-family mode's result: texts, tokens and `GenerationStats` from its fetched per-row counters (`rows`:
    tokens, num_new, accepted, draft_len, prefixes, block_tokens; `continued` where a continuation ran)."""
    n = len(req.ids)
    tokens = [rows["tokens"][i, : rows["num_new"][i]].tolist() for i in range(n)]
    accepted = [int(x) for x in rows["accepted"][:n]]
    cont_passes = target_passes - verify_passes
    continued_n = int(np.sum(rows["continued"][:n])) if "continued" in rows else None

    def total(key: str) -> int | None:
        return int(np.sum(rows[key][:n])) if key in rows else None

    stats = GenerationStats(
        new_tokens=sum(len(t) for t in tokens), seconds=seconds, target_passes=target_passes,
        verify_passes=verify_passes, rounds=rounds,
        request_passes=(verify_passes * n + cont_passes * continued_n if continued_n is not None
                        else target_passes * n),
        draft_tokens=total("draft_len"), accepted_tokens=sum(accepted),
        accepted_per_request=accepted, prefixes_per_request=[int(x) for x in rows["prefixes"][:n]],
        verify_tokens=total("block_tokens"), continued_requests=continued_n, continue_batch=continue_batch,
        eagle3_accepted_tokens=total("eagle3_accepted_tokens"), eagle3_draft_tokens=total("eagle3_draft_tokens"),
        eagle3_num_drafts=(None if "eagle3_draft_tokens" not in rows else  # each draft proposes gamma + tree nodes
                           total("eagle3_draft_tokens") // (ctx.config.eagle3.gamma + ctx.config.eagle3.tree)),
        **step_metrics(rows, n))
    texts = [ctx.target.tokenizer.decode(t) for t in tokens]
    out = stats.as_dict()
    # each request's verification passes: every pass it was live in (its first-rejected histogram counts one each),
    # else its own count where the run kept one (a served run: its admission's), else every pass of the batch
    checks = ([int(x) for x in np.asarray(rows["rejected_at"][:n]).sum(-1)] if "rejected_at" in rows
              else [int(x) for x in rows["own_verify_passes"][:n]] if "own_verify_passes" in rows
              else [verify_passes] * n)
    out.update(checks_per_request=checks, request_checks=sum(checks))
    return GenerateResult(texts=texts, tokens=tokens, stats=out)
