"""The GPU benchmark's pieces on CPU (interpret mode, tiny): its layout is the project's, a case runs end to end
and its table renders, so a broken benchmark shows up here and not on the GPU."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

from tests.verify.layout_reference import pack

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernel_bench.py"
_spec = importlib.util.spec_from_file_location("gpu_kernel_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up while the file executes
_spec.loader.exec_module(bench)


def test_packed_metadata_is_the_projects_layout():
    for case in (bench.Case(0, 512, 8), bench.Case(7, 40, 6, 4), bench.Case(3, 10, 10, 2)):
        limit, group = bench.packed_metadata(case)
        bounds = sorted({int(x) for x in limit[case.draft::case.suffix]})
        block = pack(case.cache, np.zeros(case.draft, np.int32), bounds, np.zeros(case.suffix, np.int32))
        np.testing.assert_array_equal(limit, block.limit)
        np.testing.assert_array_equal(group, block.group)
    limit, group = bench.packed_metadata(bench.Case(9, 5, 0))  # K = 0: causal prefill
    np.testing.assert_array_equal(limit, np.arange(1, 6))
    np.testing.assert_array_equal(group, np.zeros(5))


def test_a_smoke_case_runs_and_renders():
    case, heads = bench.SMOKE_CASES[0], bench.SMOKE_HEADS
    row = bench.run_case(case, heads, bench.KernelConfig(16, 16), repeats=1, interpret=True, matmul_rate=1.0,
                         dense_impls=["xla"])
    assert row["finite"] and row["max_abs_err"] < 2e-5
    assert 0 < row["tile_fraction"] < 1 and row["kernel_s"] > 0 and row["dense_masked_impl"] == "xla"
    report = {"device": "cpu", "jax": "x", "heads": {}, "kernel_config": {}, "matmul_tflops": 1.0, "repeats": 1,
              "cases": [row, {**row, "error": "boom"}], "skipped": []}
    table = bench.markdown(report)
    assert table.count("\n| ") == 3 and "error: boom" in table  # header, a row, an error row
