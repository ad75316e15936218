"""The core of benchmarks/gpu_model_cost.py at tiny shapes on CPU: params drawn on device in the model dtype, and
every timing row consistent with its own numbers (the GPU run uses the same code at real shapes)."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.models.model import Model, expected_params

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def gmc():
    sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location("gpu_model_cost", BENCH_DIR / "gpu_model_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_shapes_are_the_qwen3_ones(gmc):
    t, d = gmc.TARGET, gmc.DRAFT
    assert (t.num_layers, t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size,
            t.vocab_size, t.dtype, t.qk_norm) == (36, 4096, 32, 8, 128, 12288, 151936, "bfloat16", True)
    assert (d.num_layers, d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size) == \
        (28, 1024, 16, 8, 128, 3072)
    assert 8.0e9 < t.num_params < 8.4e9 and 0.55e9 < d.num_params < 0.65e9


@pytest.fixture(scope="module")
def tiny(gmc):
    """A bfloat16 config whose matrices share few shapes (each distinct shape is one small compile)."""
    cfg = gmc.SMOKE_TARGET.replace(hidden_size=32, intermediate_size=32, num_heads=2, num_kv_heads=2, head_dim=16,
                                   dtype="bfloat16")
    return cfg, gmc.random_params(cfg, 3)


def test_random_params_match_the_tree_in_the_model_dtype(tiny):
    cfg, params = tiny
    want = expected_params(cfg)
    flat = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert set(flat) == set(want)
    for path, x in flat.items():
        assert (x.shape, x.dtype) == (want[path].shape, jnp.bfloat16), path
        v = np.asarray(x, np.float32)
        if path[-1] == "scale":
            assert (v == 1).all()
        else:
            assert 0.01 < v.std() < 0.03 and np.isfinite(v).all(), path
    same_shape = [np.asarray(x, np.float32) for p, x in flat.items() if p[-1] != "scale" and x.shape == (32, 32)]
    assert len(same_shape) >= 2 and not np.array_equal(same_shape[0], same_shape[1])  # a fresh draw per leaf


def test_measure_rows_are_consistent(gmc, tiny):
    model = Model(*tiny)  # the draft's role is played by the same model: its decode step is the same program
    saved = []
    rows = gmc.measure(model, model, batches=(2,), draft_lens=(12,), ks=(3,), suffix=2, context=5, repeats=1,
                       passes=1, on_row=lambda rows: saved.append(len(rows)), log=lambda s: None)
    assert saved == [1] and len(rows) == 1
    r = rows[0]
    assert r["block_tokens"] == 12 + 3 * 2 and r["cache_slots"] % 128 == 0
    assert r["cache_slots"] >= 5 + 12 + 3 * 2
    for key in ("verify_ms", "prefill_ms", "target_decode_step_ms", "draft_decode_step_ms"):
        assert r[key] > 0
    assert r["verify_vs_prefill"] == pytest.approx(r["verify_ms"] / r["prefill_ms"])
    assert r["verify_vs_decode_step"] == pytest.approx(r["verify_ms"] / r["target_decode_step_ms"])
    assert r["break_even_accepted_tokens"] == pytest.approx(
        (r["verify_ms"] + 12 * r["draft_decode_step_ms"]) / r["target_decode_step_ms"])


def test_a_spent_budget_starts_nothing(gmc, tiny):
    model = Model(*tiny)
    assert gmc.measure(model, model, (1,), (8,), (2,), 2, 4, 1, 1, budget_s=-1.0, log=lambda s: None) == []
