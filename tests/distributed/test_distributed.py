"""parse_jax.distributed on fake CPU devices: every mesh shape gives the single-device results; Orbax restores a
checkpoint saved from 8 devices onto 2 (two processes: multi-host) and onto 1; bad meshes are clear errors.

The pytest process has imported jax with one device, so the 8-device checks run in one subprocess (XLA_FLAGS
set before jax starts) that writes its measurements as JSON; the 2-device checks run as two real processes of
one `jax.distributed` job (1 CPU device each, gloo collectives) started through the module's CLI flags.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from parse_jax.checkpoints.load import load_model, load_sharded
from parse_jax.distributed.args import add_distributed_args
from parse_jax.distributed.mesh import make_mesh, parse_mesh_spec
from parse_jax.distributed.multihost import initialize_from_args, is_writer, process_slice, wants_auto_distributed
from parse_jax.errors import ConfigError
from parse_jax.utils.paths import config_dir
from tests.fake_devices import device_env

pytestmark = pytest.mark.subprocess  # its module fixture runs the checks in a subprocess

ROOT = Path(__file__).resolve().parents[2]
MESHES = ["8x1", "4x2", "2x4", "1x8"]
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen, what: str) -> None:
    log = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, f"{what} failed:\n{log[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The 8-device checks; as soon as they have saved their checkpoint and references, the 2-process job starts
    beside them (the machine has 2 cores)."""
    out = tmp_path_factory.mktemp("dist")
    run = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    eight = subprocess.Popen([sys.executable, "-m", "tests.distributed.check_meshes", str(out)], env=device_env(8),
                             **run)
    deadline = time.monotonic() + 900
    while not (out / "ready").exists() and eight.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not (out / "ready").exists():
        _wait(eight, "check_meshes")
    cmd = [sys.executable, "-m", "tests.distributed.check_multihost", "--coordinator", f"localhost:{_free_port()}",
           "--num-processes", "2", "--mesh", "data=1,model=2"]
    two = [subprocess.Popen(cmd + ["--process-id", str(i), str(out)], env=device_env(1), **run) for i in range(2)]
    _wait(eight, "check_meshes")
    for i, proc in enumerate(two):
        _wait(proc, f"check_multihost process {i}")
    return out


@pytest.fixture(scope="module")
def ref_dir(runs) -> Path:
    return runs


@pytest.fixture(scope="module")
def meshes(runs) -> dict:
    return json.loads((runs / "meshes.json").read_text())


@pytest.fixture(scope="module")
def multihost(runs) -> dict:
    return json.loads((runs / "multihost.json").read_text())


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_equals_single_device(meshes, mesh):
    row = meshes["meshes"][mesh]
    assert row["q_proj_spec"] == "P(None, 'model')" and row["down_proj_spec"] == "P('model', None)"
    assert row["cache_k_spec_batch8"] == "P('data', 'model', None, None)"  # [B, KV, S, D]
    assert row["logits_max_diff"] <= TOL
    # shard_map prefix scoring equals the single-device scores: the sharded engine's prefix_scores (one request,
    # padded to the data axis) and a batch of 3 requests in one pass (padded on data 2, 4, 8)
    assert row["prefix_scores_max_diff"] <= TOL
    assert row["batch_scores_max_diff"] <= TOL
    # greedy generation through ParseEngine.generate with the sharded target (and draft on 2x4)
    assert row["target_tokens_equal"] and row["target_texts_equal"]
    assert row["parse_tokens_equal"] and row["parse_texts_equal"]
    if mesh in ("8x1", "2x4"):  # every mode there (check_meshes.ALL_MODES_ON); target and parse on the others
        for mode in ("sd", "eagle3", "parse+eagle3"):  # the draft and the EAGLE-3 head beside a sharded target
            assert row[f"{mode}_tokens_equal"] and row[f"{mode}_texts_equal"], mode
    assert row["parse_accepted_per_request"] == meshes["ref_parse_stats"]["accepted_per_request"]


def test_checks_are_not_vacuous(meshes):
    accepted = meshes["ref_parse_stats"]["accepted_per_request"]
    assert 0 < sum(accepted) < meshes["ref_parse_stats"]["draft_tokens"]  # some prefixes rejected, some kept
    assert meshes["meshes"]["2x4"]["draft_sharded"]
    assert all(len(t) > 1 for t in meshes["ref_tokens"]["parse"])


def test_request_rows_on_data_axis_decode_in_parallel(meshes):
    r = meshes["shard_rows_4x2"]
    assert r["tokens_equal"] and r["num_new_equal"] and r["tokens_spec"] == "P('data',)"
    assert meshes["sampled_sd_4x2_tokens_equal"]


def test_restore_onto_other_layout_on_8_devices(meshes):
    r = meshes["restore_1x8"]  # saved from a 2x4 mesh
    assert r["params_equal"] and r["q_proj_devices"] == 8 and r["q_proj_shard_shape"] == [64, 8]
    assert r["logits_max_diff"] <= TOL


def test_bad_input_is_a_config_error(meshes):
    errors = meshes["errors"]
    assert all(e["type"] == "ConfigError" for e in errors.values()), errors
    assert "8 device(s)" in errors["mesh_size"]["message"] and "6 devices" in errors["mesh_size"]["message"]
    assert "key/value heads" in errors["kv_heads"]["message"]
    assert "attention heads" in errors["heads"]["message"]
    assert "intermediate_size" in errors["mlp"]["message"]
    assert meshes["gqa_on_model_4_ok"]["type"] is None
    assert meshes["fallback_is_replicated"]  # a small draft may opt into replicated params instead


def test_multihost_two_processes(multihost, ref_dir):
    assert multihost["process_count"] == 2 and multihost["device_count"] == 2
    assert multihost["local_device_count"] == 1 and multihost["mesh"] == {"data": 1, "model": 2}
    assert multihost["q_proj_global_shape"] == [64, 64] and multihost["q_proj_local_shard_shape"] == [64, 32]
    assert multihost["logits_max_diff"] <= TOL  # checkpoint from 8 devices, restored across 2 processes
    assert multihost["target_tokens_equal"]
    assert multihost["scores_shapes_ok"] and multihost["scores_max_diff"] <= TOL  # 3 requests on data=2
    assert multihost["my_requests"] == [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]  # process 0's share of 7
    assert multihost["gathered_equal"]
    assert multihost["per_host_mesh_devices"] == [0] and multihost["per_host_prompts"] == 2  # 3 prompts: 2 + 1
    assert multihost["per_host_tokens_equal"]
    assert (ref_dir / "ran_0").exists() and (ref_dir / "ran_1").exists()


def test_restore_onto_one_device(ref_dir):
    mesh = make_mesh({"data": 1, "model": 1})
    model = load_sharded(ref_dir / "ckpt", mesh)
    plain = load_model(ref_dir / "ckpt")
    ids = np.load(ref_dir / "ids.npy")
    ref = np.load(ref_dir / "ref_logits.npy")
    assert np.abs(model.logits(ids) - ref).max() <= TOL
    leaves = jax.tree.leaves(model.params)
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in leaves)
    for x, y in zip(leaves, jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    half = load_sharded(ref_dir / "ckpt", mesh, dtype="bfloat16")
    assert half.config.dtype == "bfloat16" and all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(half.params))


# ---- in-process: no devices needed


def test_mesh_spec_parsing(tmp_path):
    assert parse_mesh_spec("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh_spec({"model": 4}) == {"data": 1, "model": 4}
    (tmp_path / "m.yaml").write_text("mesh:\n  data: -1\n  model: 1\n")
    assert parse_mesh_spec(str(tmp_path / "m.yaml")) == {"data": -1, "model": 1}
    assert dict(make_mesh(str(tmp_path / "m.yaml")).shape) == {"data": 1, "model": 1}
    shipped = {p.name: parse_mesh_spec(str(p))
               for p in sorted(config_dir().glob("mesh_*.yaml"))}
    assert shipped == {"mesh_data2_model4.yaml": {"data": 2, "model": 4},
                       "mesh_model_all.yaml": {"data": 1, "model": -1}}
    for bad in ("data=2,pipeline=2", "data", "data=x", {"data": 0}, {"data": -1, "model": -1}):
        with pytest.raises(ConfigError):
            parse_mesh_spec(bad)
    with pytest.raises(ConfigError, match="1 device"):
        make_mesh({"data": 2})
    for empty in ("", " , "):  # names no axis: an error, not a silent one-device mesh
        with pytest.raises(ConfigError, match=f"--mesh {empty!r} names no mesh axis: give axis=size pairs"):
            parse_mesh_spec(empty, name="--mesh")
        with pytest.raises(ConfigError, match="mesh spec .* names no mesh axis"):
            make_mesh(empty)


def test_process_slices_cover_requests_once():
    for n in (0, 1, 7, 8):
        for count in (1, 2, 3, 5):
            parts = [process_slice(list(range(n)), i, count) for i in range(count)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_cli_flags_and_environment():
    parser = add_distributed_args(argparse.ArgumentParser())
    args = parser.parse_args(["--coordinator", "h:1234", "--num-processes", "4", "--process-id", "1",
                              "--mesh", "data=2,model=4"])
    assert (args.coordinator, args.num_processes, args.process_id, args.mesh) == ("h:1234", 4, 1, "data=2,model=4")
    with pytest.raises(ConfigError, match="go together"):
        initialize_from_args(parser.parse_args(["--coordinator", "h:1"]))
    with pytest.raises(ConfigError, match="names no mesh axis"):
        initialize_from_args(parser.parse_args(["--mesh", ""]))
    with pytest.raises(ConfigError, match="process-id"):
        initialize_from_args(parser.parse_args(["--coordinator", "h:1", "--num-processes", "2",
                                                     "--process-id", "2"]))
    assert initialize_from_args(parser.parse_args([])) is None  # no flags, no cluster: nothing started
    assert is_writer()
    assert not wants_auto_distributed({})
    assert not wants_auto_distributed({"SLURM_NTASKS": "1", "TPU_WORKER_HOSTNAMES": "localhost"})
    assert wants_auto_distributed({"SLURM_NTASKS": "4"})
    assert wants_auto_distributed({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"})
    assert wants_auto_distributed({"PARSE_JAX_DISTRIBUTED": "1"})
