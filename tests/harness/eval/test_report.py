"""Wilson intervals against known values; summaries count each record key once."""

import pytest

from parse_jax.harness.eval.report import format_summary, summarize, wilson


@pytest.mark.parametrize("k, n, lo, hi", [
    (0, 10, 0.0, 0.27753), (10, 10, 0.72247, 1.0), (5, 10, 0.23659, 0.76341), (81, 100, 0.72221, 0.87485),
])
def test_wilson_known_values(k, n, lo, hi):
    assert wilson(k, n) == pytest.approx((lo, hi), abs=2e-5)


def test_wilson_edges():
    assert wilson(0, 0) == (0.0, 1.0)
    assert all(wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0 for n in range(1, 50))  # exactly, not 2.8e-17
    with pytest.raises(ValueError):
        wilson(3, 2)
    lo, hi = wilson(50, 100)
    assert lo < 0.5 < hi and hi - lo < wilson(5, 10)[1] - wilson(5, 10)[0]  # more data, narrower


def test_summary_counts_each_key_once():
    rows = [{"key": "1:a", "correct": True, "extracted": "1", "new_tokens": 4, "seconds": 1.0, "kind": "task"},
            {"key": "2:b", "correct": False, "extracted": None, "new_tokens": 6, "seconds": 1.0, "kind": "gsm8k"},
            {"key": "1:a", "correct": True, "extracted": "1", "new_tokens": 4, "seconds": 1.0, "kind": "task"}]
    s = summarize(rows)
    assert (s["n"], s["correct"], s["accuracy"], s["no_answer"], s["new_tokens"]) == (2, 1, 0.5, 1, 10)
    assert s["kinds"] == {"task": 1, "gsm8k": 1} and s["tokens_per_s"] == pytest.approx(5.0)
    assert "1/2" in format_summary(s) and "schedule" not in format_summary(s)
    rows[1]["ran"] = "target"  # a resumed file: the older records say nothing of what ran them
    assert "schedule auto ran target for 1 records (of 2)" in format_summary(summarize(rows))
