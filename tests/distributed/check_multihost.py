"""One of two processes (1 CPU device each) forming one JAX job through `parse_jax.distributed`'s CLI entry:

    python -m tests.distributed.check_multihost --coordinator localhost:PORT --num-processes 2 --process-id I \\
        --mesh data=1,model=2 REF_DIR

REF_DIR holds what `check_meshes` wrote from 8 devices: a checkpoint, reference logits and prefix scores.
Here: the checkpoint is restored onto the 2-process mesh (tensor parallel across the processes); logits, greedy
generation and (on a data=2 mesh: each process's device verifies its rows) batched prefix scores compared;
per-host slicing and the gather of results; only the writer (process 0) writes REF_DIR/multihost.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from parse_jax.checkpoints.load import load_sharded
from parse_jax.distributed.args import add_distributed_args
from parse_jax.distributed.mesh import make_mesh
from parse_jax.distributed.multihost import gather_token_lists, initialize_from_args, is_writer, process_slice
from parse_jax.distributed.verify import sharded_prefix_scores
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.runtime.programs import to_host
from tests.distributed.check_meshes import CONFIG


def main() -> None:
    t0 = time.perf_counter()
    parser = add_distributed_args(argparse.ArgumentParser())
    parser.add_argument("ref_dir", type=Path)
    args = parser.parse_args()
    jax.config.update("jax_disable_most_optimizations", True)
    mesh = initialize_from_args(args)
    ref = json.loads((args.ref_dir / "ref_scores.json").read_text())
    out: dict = {"process_count": jax.process_count(), "device_count": jax.device_count(),
                 "local_device_count": jax.local_device_count(), "mesh": dict(mesh.shape)}
    model = load_sharded(args.ref_dir / "ckpt", mesh)
    kernel = model.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    out["q_proj_local_shard_shape"] = list(kernel.addressable_shards[0].data.shape)
    out["q_proj_global_shape"] = list(kernel.shape)
    ids = np.load(args.ref_dir / "ids.npy")
    limit, group = (np.broadcast_to(np.arange(1, ids.shape[1] + 1, dtype=np.int32), ids.shape),
                    np.zeros(ids.shape, np.int32))
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    logits, _, _ = model.forward(ids.astype(np.int32), positions, model.init_cache(ids.shape[0], ids.shape[1]),
                                 limit, group)
    out["logits_max_diff"] = float(np.abs(to_host(logits) - np.load(args.ref_dir / "ref_logits.npy")).max())
    # greedy target generation through the engine's own program, on the cross-process tensor-parallel mesh
    eng = ParseEngine(model, model, ParseConfig(**CONFIG, schedule="fixed"))
    res = eng.generate(["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :"], mode="target",
                       max_new_tokens=20)
    out["target_tokens_equal"] = res.tokens == ref["tokens_target"]
    # a batch of requests verified in one pass, rows spread over the processes (data=2: 3 requests padded to 4)
    data_mesh = make_mesh({"data": 2, "model": 1})
    got = sharded_prefix_scores(eng, ref["contexts"], ref["drafts"], ref["boundaries"], mesh=data_mesh)
    out["scores_shapes_ok"] = [len(g) for g in got] == [len(s) for s in ref["scores"]]
    out["scores_max_diff"] = max(float(np.abs(g - s).max()) for g, s in zip(got, ref["scores"]))
    # per-host serving: each process generates its share of the prompts on its own device, process 0 gathers
    prompts = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :"]
    host_args = parser.parse_args(["--per-host", "--mesh", "data=1,model=1", str(args.ref_dir)])
    local_mesh = initialize_from_args(host_args)
    out["per_host_mesh_devices"] = [d.id for d in local_mesh.devices.flat]
    local_model = load_sharded(args.ref_dir / "ckpt", local_mesh)
    local = ParseEngine(local_model, local_model, ParseConfig(**CONFIG, schedule="fixed"))
    mine = process_slice(prompts)
    tokens = local.generate(mine, mode="target", max_new_tokens=20).tokens
    out["per_host_prompts"] = len(mine)
    out["per_host_tokens_equal"] = gather_token_lists(tokens, len(prompts)) == ref["tokens_target"]
    # per-host input feeding and the gather of results (ragged rows, uneven shares)
    requests = [[i] * (i % 4 + 1) for i in range(7)]
    mine = process_slice(requests)
    out["my_requests"] = mine
    out["gathered_equal"] = gather_token_lists([r + [99] for r in mine], len(requests)) == [
        r + [99] for r in requests]
    out["seconds"] = time.perf_counter() - t0
    if is_writer():
        (args.ref_dir / "multihost.json").write_text(json.dumps(out, indent=1))
    (args.ref_dir / f"ran_{jax.process_index()}").write_text("ok")


if __name__ == "__main__":
    main()
