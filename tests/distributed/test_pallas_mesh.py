"""A sharded engine with attention_impl="pallas" gives the unsharded reference's tokens and scores, the kernels
running under `shard_map` inside its programs (8 fake CPU devices in a subprocess; the kernel interpreted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.check_pallas_mesh import MODES
from tests.distributed.test_distributed import ROOT
from tests.fake_devices import device_env

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]
TOL = 1e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pallas_mesh")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.check_pallas_mesh", str(out)],
        cwd=ROOT,
        env=device_env(8),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads((out / "pallas_mesh.json").read_text())


def test_every_mode_on_a_2x4_mesh_equals_the_unsharded_reference(result):
    row = result["meshes"]["2x4"]
    assert row["attention_impl"] == "pallas"
    for mode in MODES:
        assert row[f"{mode}_tokens_equal"], mode
        assert row[f"{mode}_tokens"] > len(MODES), mode  # something was generated
    assert row["prefix_scores_max_diff"] <= TOL and row["batch_scores_max_diff"] <= TOL


def test_a_4x2_mesh_and_an_unsharded_draft_equal_the_reference(result):
    row = result["meshes"]["4x2"]
    assert row["target_tokens_equal"]
    assert row["prefix_scores_max_diff"] <= TOL and row["batch_scores_max_diff"] <= TOL
    assert result["unsharded_draft_parse_tokens_equal"]


def test_the_kernels_run_under_shard_map_only_on_the_engine_s_mesh(result):
    """One shard_map region per attention call traced under the mesh; none off it (where GSPMD would have to
    partition the kernel, which it cannot do for a compiled Mosaic or Triton call)."""
    for mode, counts in result["manual_computations"].items():
        assert counts["mesh"] >= 1 and counts["no_mesh"] == 0, (mode, counts)
