"""The price of one more verified prefix (prefix_choice "auto"): nothing where a pass costs its weights' bytes
whatever its tokens, more where passes are compute-bound and the more rows share a pass, a whole pass where each
prefix is verified on its own."""

import pytest

from parse_jax.errors import ConfigError
from parse_jax.schedule.costs import PassCosts, roofline
from parse_jax.schedule.prefix_price import prefix_price
from tests.schedule.test_costs import EMBEDDED_TARGET, table_of

ARGS = dict(draft_tokens=32, suffix_tokens=4, cache_len=256)


def test_a_memory_bound_pass_prices_a_prefix_at_nothing():
    costs = PassCosts(target=roofline(EMBEDDED_TARGET, kind="NVIDIA H200"))
    assert prefix_price(costs, batch=1, **ARGS) == 0.0


def test_a_compute_bound_pass_prices_a_prefix_higher_the_more_rows_share_it():
    # a fixed cost per pass plus a cost per row-token: what a CPU's profile looks like
    costs = PassCosts(target=table_of(lambda b, t, c: 1e-3 + 2e-5 * b * t, tokens=(1, 8, 64)))
    prices = [prefix_price(costs, batch=b, **ARGS) for b in (1, 4, 16)]
    assert 0.0 < prices[0] < prices[1] < prices[2]
    # one row: 4 more tokens cost 8e-5 s against a one-token pass's 1.02e-3 s
    assert prices[0] == pytest.approx(8e-5 / 1.02e-3, rel=1e-6)


def test_a_prefix_verified_in_its_own_pass_costs_that_pass():
    costs = PassCosts(target=table_of(lambda b, t, c: 1e-3 + 2e-5 * b * t, tokens=(1, 8, 64)))
    packed = prefix_price(costs, batch=1, **ARGS)
    alone = prefix_price(costs, batch=1, separate_passes=True, **ARGS)
    assert alone == pytest.approx((1e-3 + 2e-5 * 36) / 1.02e-3, rel=1e-6)
    assert alone > 1.0 > packed


@pytest.mark.parametrize("field", ["batch", "draft_tokens", "suffix_tokens", "cache_len"])
def test_bad_sizes_are_refused_by_name(field):
    costs = PassCosts(target=roofline(EMBEDDED_TARGET, kind="NVIDIA H200"))
    with pytest.raises(ConfigError, match=field):
        prefix_price(costs, **{"batch": 1, **ARGS, field: 0})
