"""The roofline and measured cost tables: positive, monotone, exact on the grid, interpolated between."""

import itertools

import numpy as np
import pytest

from parse_jax.errors import ConfigError
from parse_jax.schedule.costs import CostTable, ModelShape, PassCosts, Roofline, device_for, roofline
from tests.random_models import tiny_config

EMBEDDED_TARGET = tiny_config("llama3", vocab_size=27, hidden_size=384, intermediate_size=1152, num_layers=8,
                              num_heads=12, num_kv_heads=12, head_dim=32, tie_word_embeddings=True)


def table_of(fn, batches=(1, 4, 16), tokens=(1, 8, 64), caches=(64, 256)) -> CostTable:
    grid = [[[fn(b, t, c) for c in caches] for t in tokens] for b in batches]
    return CostTable(batches, tokens, caches, grid)


@pytest.mark.parametrize("kind, name", [("NVIDIA H100 80GB HBM3", "NVIDIA H100"), ("NVIDIA H200", "NVIDIA H200"),
                                        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100"), ("TPU v4", "TPU v4"),
                                        ("TPU v5 lite", "TPU v5e"), ("TPU v5", "TPU v5p"),
                                        ("TPU v6 lite", "TPU v6e"), ("cpu", "CPU (2-core AVX2 share)")])
def test_device_table_keyed_by_device_kind(kind, name):
    assert device_for(kind).name == name


def test_unknown_device_gets_cpu_figures_under_its_own_name():
    dev = device_for("Quantum Abacus 9000")
    assert "Quantum Abacus 9000" in dev.name and dev.bandwidth == device_for("cpu").bandwidth


@pytest.mark.parametrize("kind", ["cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite"])
@pytest.mark.parametrize("eagle3", [False, True])
def test_roofline_positive_and_monotone(kind, eagle3):
    cfg = EMBEDDED_TARGET.replace(num_layers=1) if eagle3 else EMBEDDED_TARGET
    r = roofline(cfg, kind, eagle3=eagle3)
    axis = (1, 2, 4, 16, 64)
    for b, t, c in itertools.product(axis, axis, (64, 512)):
        s = r.seconds(b, t, c)
        assert s > 0
        assert r.seconds(b + 1, t, c) >= s and r.seconds(b, t + 1, c) >= s and r.seconds(b, t, c + 64) >= s


def test_roofline_regimes_memory_bound_step_compute_bound_block():
    """One token at batch 1 costs about the weights' read; a large block costs its FLOPs."""
    r = roofline(EMBEDDED_TARGET, "cpu")
    dev, shape = r.device, r.shape
    step = r.seconds(1, 1, 1) - dev.overhead_s - shape.layers * dev.layer_overhead_s
    assert step == pytest.approx((shape.weight_bytes + shape.kv_bytes_per_slot) / dev.bandwidth)
    big = r.seconds(64, 128, 1) - dev.overhead_s - shape.layers * dev.layer_overhead_s
    flops = 64 * 128 * (shape.matmul_flops_per_token + shape.attn_flops_per_slot)
    assert big == pytest.approx(flops / dev.flops_f32)
    assert r.seconds(1, 8, 256) < 1.5 * r.seconds(1, 1, 256)  # speculation's premise at batch 1


def test_model_shape_counts_the_weights_once():
    shape = ModelShape.of(EMBEDDED_TARGET)
    assert shape.weight_bytes == EMBEDDED_TARGET.num_params * 4  # tied: the table is the LM head, read whole
    untied = EMBEDDED_TARGET.replace(tie_word_embeddings=False)
    assert ModelShape.of(untied).weight_bytes == shape.weight_bytes  # the lookup reads only the block's rows
    bf16 = ModelShape.of(EMBEDDED_TARGET.replace(dtype="bfloat16"))
    assert bf16.weight_bytes == shape.weight_bytes / 2 and bf16.kv_bytes_per_slot == shape.kv_bytes_per_slot / 2


def test_table_exact_on_grid_points():
    fn = lambda b, t, c: 1e-3 * (1 + b * t) + 1e-6 * b * c  # noqa: E731
    table = table_of(fn)
    for b, t, c in itertools.product(table.batches, table.tokens, table.caches):
        assert table.seconds(b, t, c) == pytest.approx(fn(b, t, c), rel=1e-12)


def test_table_interpolation_is_trilinear():
    fn = lambda b, t, c: 1e-3 * b + 1e-4 * t + 1e-6 * c + 1e-5 * b * t  # noqa: E731  (linear in each axis)
    table = table_of(fn)
    for b, t, c in [(2, 3, 100), (10, 30, 200), (3, 1, 64), (16, 64, 256), (7, 50, 150)]:
        assert table.seconds(b, t, c) == pytest.approx(fn(b, t, c), rel=1e-9)


def test_table_monotone_between_grid_points():
    rng = np.random.default_rng(0)
    increments = rng.uniform(0.1, 1.0, size=(3, 3, 2))
    grid = np.cumsum(np.cumsum(np.cumsum(increments, 0), 1), 2) * 1e-3
    table = CostTable((1, 4, 16), (1, 8, 64), (64, 256), grid.tolist())
    batches, tokens, caches = range(1, 40), range(1, 200, 3), range(32, 600, 37)
    values = np.array([[[table.seconds(b, t, c) for c in caches] for t in tokens] for b in batches])
    assert (values > 0).all()
    for axis in range(3):
        assert (np.diff(values, axis=axis) >= -1e-15).all()


def test_table_beyond_largest_tokens_grows_in_proportion():
    table = table_of(lambda b, t, c: 1e-3 * b * t)
    assert table.seconds(4, 128, 64) == pytest.approx(2 * table.seconds(4, 64, 64))
    assert table.seconds(32, 64, 64) > table.seconds(16, 64, 64)  # past the largest batch: along the last slope


def test_past_the_grid_a_falling_last_segment_stays_at_the_edge():
    """A profile keeps a larger shape that timed faster (its figure stands); along that falling segment a cost past
    the grid went to zero and below (then plain decoding's calibration divided by it). It stays at the edge."""
    grid = [[[3e-3, 1e-3] for _ in range(2)] for _ in range(2)]  # the larger cache timed a third of the smaller
    table = CostTable((1, 4), (1, 8), (256, 512), grid)
    assert table.seconds(1, 1, 512) == pytest.approx(1e-3)
    for cache in (700, 1024, 4096):
        assert table.seconds(1, 1, cache) == pytest.approx(1e-3)
    grid = [[[4e-3, 4e-3]] * 2, [[1e-3, 1e-3]] * 2]  # batch 4 timed below batch 1
    table = CostTable((1, 4), (1, 8), (256, 512), grid)
    assert table.seconds(16, 8, 512) == pytest.approx(1e-3)


def test_table_round_trip_and_bad_input():
    table = table_of(lambda b, t, c: 1e-3 * b * t + 1e-6 * c)
    assert CostTable.from_dict(table.to_dict()) == table
    with pytest.raises(ConfigError, match=r"seconds_grid must have shape \[3, 3, 2\]"):
        CostTable((1, 4, 16), (1, 8, 64), (64, 256), [[[1.0, 1.0]] * 3] * 2)
    with pytest.raises(ConfigError, match="cost table tokens must be strictly increasing"):
        CostTable((1,), (8, 1), (64,), [[[1.0], [1.0]]])
    with pytest.raises(ConfigError, match="cost table seconds must lie in"):
        CostTable((1,), (1,), (64,), [[[0.0]]])
    with pytest.raises(ConfigError, match="malformed cost table"):
        CostTable.from_dict({"batches": [1]})


def test_pass_costs_names_a_missing_role():
    costs = PassCosts(target=roofline(EMBEDDED_TARGET, "cpu"))
    assert costs.sources == {"target": "roofline"}
    assert isinstance(costs.target, Roofline)
    with pytest.raises(ConfigError, match="no draft pass cost"):
        costs.seconds("draft", 1, 1, 64)
