"""What one more verified prefix costs, in the draft tokens it must be expected to keep to pay for itself:
prefix_choice "auto" (docs/design.md §2) verifies a step end only where the draft's own probabilities say it keeps
at least that many (`verify.segment.select_by_value`, inside the device program).

A prefix adds one copy of the verification suffix (S tokens) to each row's block. At batch B the target's pass
grows by t(B, D + 2S) - t(B, D + S) seconds (a D-token draft; the cost model's slope where the block lies), while a
token the verification keeps saves a target step, about t(B, 1) seconds (the target writing it itself, or
re-verifying it in the next round). The price is their ratio: small at batch 1 on an accelerator (a pass costs its
weights' bytes, whatever its tokens), large where a pass is compute-bound (a CPU, a large batch), where only a step
the draft doubts is worth a suffix copy.

Mode `sequential` verifies each prefix in a pass of its own, so there one more prefix costs a whole pass (priced as
one over the full draft and its suffix, the longest such pass), not S more tokens in a packed block.
"""

from __future__ import annotations

from parse_jax.schedule.costs import PassCosts
from parse_jax.utils.validation import check_int


def prefix_price(costs: PassCosts, *, batch: int, draft_tokens: int, suffix_tokens: int, cache_len: int,
                 separate_passes: bool = False) -> float:
    """Draft tokens one more verified prefix must be expected to keep, at `batch` rows; returns >= 0.
    `separate_passes`: each prefix is verified in its own pass (mode `sequential`)."""
    for name, value in (("batch", batch), ("draft_tokens", draft_tokens), ("suffix_tokens", suffix_tokens),
                        ("cache_len", cache_len)):
        check_int(name, value, 1)
    block = draft_tokens + suffix_tokens
    if separate_passes:
        extra = costs.seconds("target", batch, block, cache_len)
    else:
        extra = (costs.seconds("target", batch, block + suffix_tokens, cache_len)
                 - costs.seconds("target", batch, block, cache_len))
    step = costs.seconds("target", batch, 1, cache_len)
    return max(extra, 0.0) / step
