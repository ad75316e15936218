"""Run under 8 fake CPU devices (the caller sets XLA_FLAGS before this starts): a sharded engine with
attention_impl="pallas" against the unsharded engine with the reference attention; writes OUT_DIR/pallas_mesh.json
for `tests/distributed/test_pallas_mesh.py` to judge.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.distributed.check_pallas_mesh OUT_DIR

On CPU "pallas" is the GPU kernel in jax's Pallas interpreter; under the engine's mesh (`jax.set_mesh`) it runs
under `shard_map`, one kernel per device's rows and heads, the path a TPU or GPU mesh compiles. Each program's
lowering is read for its manual computations (shard_map) with and without the mesh, so a run that fell back to
GSPMD partitioning the interpreter (what a compiled kernel cannot have) is told apart from one that did not.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from parse_jax.distributed.mesh import make_mesh, on_mesh
from parse_jax.distributed.sharded import shard_model
from parse_jax.distributed.verify import sharded_prefix_scores
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.lowering.launches import mode_launches
from parse_jax.models.model import Model
from tests.distributed.check_meshes import PROMPTS, TOK, requests, scores_diff
from tests.distributed.check_meshes import models as reference_models

MODES = ("target", "parse", "sd", "sequential", "eagle3", "parse+eagle3")
CONFIG = dict(max_draft_tokens=12, threshold=0.5, segmenter="stride", stride=3, schedule="fixed")
MAX_NEW = 12


def models(impl: str) -> tuple[Model, Model]:
    """check_meshes's random target (with its EAGLE-3 head) and draft, attending with `impl`."""
    target, draft = reference_models()
    with_impl = lambda m: Model(m.config, m.params, TOK, impl)  # noqa: E731
    t = with_impl(target)
    t.eagle3 = target.eagle3
    return t, with_impl(draft)


def manual_computations(engine: ParseEngine, mode: str, mesh) -> int:
    """How many shard_map regions the lowered program of `mode` holds when traced under `mesh` (None: no mesh)."""
    req = engine.request(PROMPTS, mode, MAX_NEW, 0.0, 0, 0, 1.0, None)
    launch = mode_launches(engine.context, mode, req)[0]
    with on_mesh(mesh):
        text = launch.program.trace(*launch.args).lower().as_text()
    return text.count("sdy.manual_computation")


def main() -> dict:
    t0 = time.perf_counter()
    assert jax.device_count() == 8, jax.devices()
    ref = ParseEngine(*models("xla"), ParseConfig(**CONFIG))
    ref_gen = {mode: ref.generate(PROMPTS, mode=mode, max_new_tokens=MAX_NEW) for mode in MODES}
    contexts, drafts, bounds = requests(np.random.default_rng(2))
    ref_scores = [ref.prefix_scores(c, d, b) for c, d, b in zip(contexts, drafts, bounds, strict=True)]
    out: dict = {"seconds_reference": time.perf_counter() - t0, "meshes": {}}
    for d, m in ((2, 4), (4, 2)):
        mesh = make_mesh({"data": d, "model": m})
        target, draft = models("pallas")
        eng = ParseEngine(target, draft, ParseConfig(**CONFIG), mesh=mesh)
        row: dict = {"attention_impl": eng.target.attention_impl}
        for mode in MODES if (d, m) == (2, 4) else ("target",):
            t1 = time.perf_counter()
            res = eng.generate(PROMPTS, mode=mode, max_new_tokens=MAX_NEW)
            row[f"{mode}_tokens_equal"] = res.tokens == ref_gen[mode].tokens
            row[f"{mode}_tokens"] = sum(len(t) for t in res.tokens)
            row[f"seconds_{mode}"] = round(time.perf_counter() - t1, 2)
        row["prefix_scores_max_diff"] = scores_diff(
            [eng.prefix_scores(c, x, b) for c, x, b in zip(contexts, drafts, bounds, strict=True)], ref_scores
        )
        row["batch_scores_max_diff"] = scores_diff(sharded_prefix_scores(eng, contexts, drafts, bounds), ref_scores)
        out["meshes"][f"{d}x{m}"] = row
    # the draft left on one device beside the sharded target (a small draft need not be split)
    mesh = make_mesh({"data": 2, "model": 4})
    target, draft = models("pallas")
    mixed = ParseEngine(shard_model(target, mesh), draft, ParseConfig(**CONFIG))
    res = mixed.generate(PROMPTS, mode="parse", max_new_tokens=MAX_NEW)
    out["unsharded_draft_parse_tokens_equal"] = res.tokens == ref_gen["parse"].tokens
    eng = ParseEngine(*models("pallas"), ParseConfig(**CONFIG), mesh=mesh)
    out["manual_computations"] = {
        mode: {"mesh": manual_computations(eng, mode, mesh), "no_mesh": manual_computations(eng, mode, None)}
        for mode in ("target", "parse")
    }
    out["seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    jax.config.update("jax_disable_most_optimizations", True)
    folder = Path(sys.argv[1])
    (folder / "pallas_mesh.json").write_text(json.dumps(main(), indent=1))
