"""The field's metrics from raw counts: rates from summed counts, lists added elementwise, nothing averaged."""

import pytest

from parse_jax.runtime.metrics import combine, derived
from parse_jax.runtime.requests import GenerateResult, merge_results


def test_rates_come_from_the_counts():
    d = derived({"num_drafts": 10, "num_accepted_tokens": 12, "num_accepted_tokens_per_pos": [6, 4, 2]})
    assert d["acceptance_length"] == pytest.approx(2.2)
    assert d["acceptance_rate_per_pos"] == pytest.approx([0.6, 0.4, 0.2])
    assert d["conditional_acceptance_rate_per_pos"] == pytest.approx([0.6, 4 / 6, 0.5])
    assert derived({"num_drafts": 0, "num_accepted_tokens": 0})["acceptance_length"] is None
    assert derived({"num_verifications": 4, "accepted_tokens": 10})["accepted_tokens_per_verification"] == 2.5


def test_batches_merge_by_their_counts_not_by_averaging_their_rates():
    a = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 6, "num_accepted_tokens_per_pos": [2, 2, 2],
         "accepted_tokens": 6, "first_rejected_step_hist": [1, 0, 1]}
    b = {"num_drafts": 8, "num_draft_tokens": 24, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [0, 0, 0],
         "accepted_tokens": 0, "first_rejected_step_hist": [3, 1, 0]}
    c = combine([a, b])
    assert c["acceptance_length"] == pytest.approx(1 + 6 / 10)  # not the mean of 4.0 and 1.0
    assert c["first_rejected_step_hist"] == [4, 1, 1] and c["num_accepted_tokens_per_pos"] == [2, 2, 2]
    parts = [GenerateResult(["x"], [[1]], {"new_tokens": 1, "seconds": 1.0, "target_passes": 3, **s}) for s in (a, b)]
    merged = merge_results(parts).stats
    assert merged["acceptance_length"] == pytest.approx(1.6) and merged["num_drafts"] == 10
    assert merged["acceptance_rate_per_pos"] == pytest.approx([0.2, 0.2, 0.2])
