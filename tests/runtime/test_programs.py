"""A served run on weights committed to a device (what loaded checkpoints are) sets each of its programs up once:
its first state is committed like the weights, so no program is lowered and loaded again when that state comes
back from its first call committed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.runtime.programs import _PROGRAMS, committed
from tests.modes.test_parse_multi_eagle3 import DRAFT, HEAD, PROMPTS, TARGET


def _on_device(model):
    return model.with_params(jax.device_put(model.params, jax.devices()[0]))


@pytest.mark.parametrize("mode, rounds", [("target", "single"), ("sd", "single"), ("sequential", "single"),
                                          ("parse", "single"), ("parse", "multi"), ("eagle3", "single"),
                                          ("parse+eagle3", "single"), ("parse+eagle3", "multi")])
def test_a_served_run_on_committed_weights_sets_each_program_up_once(mode, rounds):
    eng = ParseEngine(_on_device(TARGET), _on_device(DRAFT), ParseConfig(schedule="fixed", rounds=rounds),
                      eagle3=HEAD)
    before = {id(p): p._cache_size() for p in _PROGRAMS}
    res = eng.generate(PROMPTS, mode=mode, max_new_tokens=8, max_batch=1, eos_ids=[])  # 3 admissions of one row
    grew = {(id(p), p.__name__): p._cache_size() - before.get(id(p), 0) for p in _PROGRAMS
            if p._cache_size() != before.get(id(p), 0)}
    assert res.stats["admissions"] == 3 and "admit" in {name for _, name in grew}  # no other test serves these
    assert all(n == 1 for n in grew.values()), grew


def test_the_first_state_goes_where_the_committed_weights_are_else_stays_on_its_own_device():
    state = {"a": jnp.zeros((2, 3)), "n": jnp.int32(0)}
    on_device = jax.device_put(np.ones(2), jax.devices()[-1])
    out = committed(state, ({"w": np.ones(2)}, {"v": on_device}))  # the first committed weight decides
    assert all(x.committed and x.devices() == on_device.devices() for x in jax.tree.leaves(out))
    np.testing.assert_array_equal(out["a"], state["a"])
    host = committed(state, {"w": np.ones(2)})
    assert all(x.committed and x.devices() == state["a"].devices() for x in jax.tree.leaves(host))
