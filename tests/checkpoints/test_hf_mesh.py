"""A HF folder loaded with `load_model(path, mesh=...)` lands sharded with every device reading only its own slice
of the safetensors files (`get_slice` inside `jax.make_array_from_callback`), and equals the one-device load.
The 8 fake CPU devices need XLA_FLAGS before jax starts: the checks run in a subprocess (check_hf_mesh.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fake_devices import device_env
from tests.models.hf_tiny import make_tiny_hf

pytestmark = pytest.mark.subprocess  # its module fixture runs the checks in a subprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf-mesh")
    make_tiny_hf("qwen3", root / "qwen3-sharded", seed=4, sharded=True)
    make_tiny_hf("qwen2", root / "qwen2-bf16", seed=5, dtype="bfloat16")
    out = root / "results.json"
    proc = subprocess.run([sys.executable, "-m", "tests.checkpoints.check_hf_mesh", str(root), str(out)], cwd=ROOT,
                          env=device_env(8), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(measured) -> list[dict]:
    return measured["loads"]


def test_sharded_load_equals_one_device_load(results) -> None:
    assert [(r["folder"], r["mesh"]) for r in results] == [
        ("qwen3-sharded", "4x2"), ("qwen3-sharded", "1x8"), ("qwen2-bf16", "4x2"), ("qwen2-bf16", "1x8")]
    for r in results:
        assert r["type"] == "ShardedModel"
        assert r["params_equal"], r["folder"]
        # float32: tight; bfloat16: sharded matmuls sum in another order, one bf16 step of the largest logit
        tol = 1e-4 if "bf16" not in r["folder"] else 2 ** -7 * r["logits_scale"]
        assert r["logits_diff"] <= tol, (r["folder"], r["mesh"], r["logits_diff"])


def test_each_callback_reads_only_its_slice(results) -> None:
    for r in results:
        assert set(r["reads"]) == set(r["holds"])  # every tensor read, nothing else
        for tensor, reads in r["reads"].items():
            held = r["holds"][tensor]
            for index, size in reads:
                assert index in held, (r["mesh"], tensor, index)  # a device's own slice, never more
                assert size == int(np.prod([b - a for a, b in index]))
        if r["mesh"] == "4x2":  # tensor parallel: heads, MLP and vocab are split over `model`
            assert any("q_proj" in t for t in r["split"]) and any("gate_proj" in t for t in r["split"])
            assert "model.embed_tokens.weight" in r["split"]
            split = [t for t in r["split"] for index, size in r["reads"][t] if size < r["sizes"][t]]
            assert set(split) == set(r["split"])  # the split tensors were never read whole
        else:  # 1x8 with fallback_replicated: 2 KV heads do not divide over 8, every device holds everything
            assert r["split"] == []


def test_non_finite_values_are_found_by_the_slice_readers(measured) -> None:
    non_finite = measured["non_finite"]
    assert non_finite.startswith("checkpoint ") and "non-finite" in non_finite
    assert "model.layers.1.mlp.up_proj.weight (model-" in non_finite
