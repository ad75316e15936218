"""The field's speculation metrics, from the raw counts the device loops return: vLLM's names for token-level
speculation (modes sd and eagle3) and PARSE's per-step figures. Counts add up over batches and requests; the rates
are derived from the summed counts (never averaged), so a merged result reads as one run. Nothing here imports jax.

Token-level speculation (sd, eagle3), over every verification pass a request was live in (`num_drafts` of them):

- `num_drafts`: draft proposals verified (one per live request per target verification pass);
- `num_draft_tokens`: tokens proposed (gamma per draft; EAGLE-3 trees add their leaves);
- `num_accepted_tokens`: proposed tokens accepted;
- `num_accepted_tokens_per_pos[i]`: drafts whose token at position i (0-based) was accepted. Acceptance stops at
  the first rejection, so position i is accepted only if every position before it was: the counts never rise and
  sum to `num_accepted_tokens`;
- `acceptance_length` = 1 + num_accepted_tokens / num_drafts: tokens a verification pass yields, the target's own
  (correction or bonus) token included (vLLM's "mean acceptance length"; `accepted_per_pass`, the older figure,
  counts per target pass instead: docs/metrics.md);
- `acceptance_rate_per_pos[i]` = num_accepted_tokens_per_pos[i] / num_drafts (vLLM's per-position acceptance
  rate), so acceptance_length = 1 + sum_i acceptance_rate_per_pos[i];
- `conditional_acceptance_rate_per_pos[i]` = acceptance_rate_per_pos[i] / acceptance_rate_per_pos[i - 1] (for
  i = 0: acceptance_rate_per_pos[0]): the chance that position i is accepted given that position i - 1 was; the
  rates multiply out: acceptance_rate_per_pos[i] = prod_{j <= i} conditional_acceptance_rate_per_pos[j], so
  acceptance_length = 1 + sum_i prod_{j <= i} conditional_acceptance_rate_per_pos[j].

PARSE (parse, parse+eagle3), over every verification pass of every request (`num_verifications`):

- `num_steps_drafted`: step-prefixes the draft wrote and the target scored;
- `first_rejected_step_hist[k]` (k < max_prefixes): passes whose first rejected prefix (judge score below the
  threshold) was prefix k (0-based, in draft order); the last bin: passes where no prefix was rejected;
- `accepted_score_hist` / `rejected_score_hist`: the judge scores of the accepted prefixes (those up to the one
  kept) and of the others, in `SCORE_BINS` equal bins over [0, 1];
- `accepted_tokens_per_verification` = accepted_tokens / num_verifications: draft tokens kept per request per
  verification pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

SCORE_BINS = 10
COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_steps_drafted", "num_verifications")
LIST_COUNTS = ("num_accepted_tokens_per_pos", "first_rejected_step_hist", "accepted_score_hist",
               "rejected_score_hist")
DERIVED = ("acceptance_length", "acceptance_rate_per_pos", "conditional_acceptance_rate_per_pos",
           "accepted_tokens_per_verification")


def derived(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The rates of `stats`' raw counts (see the module doc); empty where the counts are absent."""
    out: dict[str, Any] = {}
    drafts = stats.get("num_drafts")
    if drafts is not None:
        out["acceptance_length"] = 1.0 + stats["num_accepted_tokens"] / drafts if drafts else None
        per = stats.get("num_accepted_tokens_per_pos")
        if per is not None:
            out["acceptance_rate_per_pos"] = [x / drafts if drafts else 0.0 for x in per]
            before = [drafts, *per[:-1]]
            out["conditional_acceptance_rate_per_pos"] = [x / b if b else 0.0 for x, b in zip(per, before)]
    checks = stats.get("num_verifications")
    if checks is not None and "accepted_tokens" in stats:
        out["accepted_tokens_per_verification"] = stats["accepted_tokens"] / checks if checks else None
    return out


def add_counts(total: dict[str, Any], part: Mapping[str, Any]) -> None:
    """Add `part`'s raw counts into `total` (lists elementwise)."""
    for key in COUNTS:
        if part.get(key) is not None:
            total[key] = total.get(key, 0) + int(part[key])
    for key in LIST_COUNTS:
        if part.get(key) is not None:
            old, new = list(total.get(key) or []), list(part[key])
            width = max(len(old), len(new))  # gamma may differ between runs: the shorter one is padded
            old, new = old + [0] * (width - len(old)), new + [0] * (width - len(new))
            total[key] = [int(a) + int(b) for a, b in zip(old, new)]


def combine(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The raw counts of several results summed, with their rates derived (and `accepted_tokens` summed, which the
    per-verification figure needs)."""
    total: dict[str, Any] = {}
    accepted = None
    for part in parts:
        add_counts(total, part)
        if part.get("accepted_tokens") is not None:
            accepted = (accepted or 0) + int(part["accepted_tokens"])
    if accepted is not None:
        total["accepted_tokens"] = accepted
    return {**total, **derived(total)}
