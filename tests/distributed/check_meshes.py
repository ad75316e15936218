"""Run under 8 fake CPU devices (the caller sets XLA_FLAGS before this starts): every mesh shape against the
single-device model; writes OUT_DIR/meshes.json (measurements for `tests/distributed/test_distributed.py` to judge), a
checkpoint saved from 8 devices, and the reference values the other device counts compare with.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.distributed.check_meshes OUT_DIR

XLA's optimisation passes are turned off (`jax_disable_most_optimizations`): compiling dominates these checks on
a 2-core machine, and the reference and the sharded runs compare under the same setting.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from parse_jax.checkpoints.load import load_sharded
from parse_jax.checkpoints.orbax import params_equal, save_model
from parse_jax.distributed.mesh import make_mesh
from parse_jax.distributed.sharded import ShardedModel, shard_model, shard_rows
from parse_jax.distributed.verify import sharded_prefix_scores
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ParseJaxError
from parse_jax.models.model import Model, param_shapes
from parse_jax.models.sharding import ShardingRules, abstract_params, fitting_rules
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.runtime.decode import _generate_program
from parse_jax.runtime.requests import SamplingParams, encode_prompts, pad_prompts, resolve_eos
from parse_jax.runtime.sampling import Sampler
from parse_jax.speculation.eagle3 import Eagle3, Eagle3Config, init_head
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import random_model, tiny_config

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
TOK = Tokenizer.from_folder(TOKENIZER_DIR)
V = TOK.vocab_size
PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :"]  # 3: pads on data 2, 4, 8
SHAPE = dict(vocab_size=V, num_heads=8, num_kv_heads=8, head_dim=8, hidden_size=64, intermediate_size=128,
             num_layers=1)
CONFIG = dict(max_draft_tokens=12, threshold=0.5, segmenter="stride", stride=3)  # accepts part of each draft
DRAFT_SHARDED_ON = (2, 4)  # elsewhere the draft stays on one device (a small draft need not be split)
# every mode on a data-only mesh and on one that splits both axes (the draft sharded too); target and parse on the
# other two shapes (each further mode is 5-20 s of compiling per mesh on a 2-core machine)
ALL_MODES_ON = ((8, 1), (2, 4))


def models() -> tuple[Model, Model]:
    target = random_model("qwen3", 70, **SHAPE)
    draft = random_model("llama3", 71, **SHAPE)
    target = Model(target.config, target.params, TOK)
    cfg = Eagle3Config.for_target(target.config)  # a random EAGLE-3 head: modes eagle3 and parse+eagle3 run too
    rng = np.random.default_rng(72)
    target.eagle3 = Eagle3(cfg, jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, 0.05, x.shape).astype(np.float32),
                                             init_head(cfg, 72)))
    return target, Model(draft.config, draft.params, TOK)


def requests(rng: np.random.Generator):
    contexts = [rng.integers(0, V, n).tolist() for n in (5, 9, 3)]
    drafts = [rng.integers(0, V, n).tolist() for n in (11, 6, 8)]
    return contexts, drafts, [[2, 6, 11], [6], [1, 4, 8]]


def scores_diff(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """Largest score difference over requests (inf when a request's prefix count differs)."""
    if [len(g) for g in got] != [len(r) for r in ref]:
        return float("inf")
    return max(float(np.abs(g - r).max()) for g, r in zip(got, ref))


def rows_generate(model: Model, sharded: Model, mesh) -> dict:
    """decode's generation program fed `shard_rows` inputs (what the decode.generate hook would pass)."""
    ids = encode_prompts(model, PROMPTS + PROMPTS[:1])
    prompt, lens, max_new = pad_prompts(ids, 4, 16, 12)
    rest = (resolve_eos(model), SamplingParams().args(4))
    program = _generate_program(model.config, model.attention_impl, 16, 32, Sampler(greedy=True))
    ref = program(model.params, prompt, lens, max_new, *rest)
    got = program(sharded.params, *(shard_rows(x, mesh) for x in (prompt, lens, max_new)), *rest)
    return {"tokens_equal": bool((np.asarray(got[0]) == np.asarray(ref[0])).all()),
            "num_new_equal": bool((np.asarray(got[1]) == np.asarray(ref[1])).all()),
            "tokens_spec": str(got[0].sharding.spec)}


def error_of(fn) -> dict:
    try:
        fn()
    except ParseJaxError as e:
        return {"type": type(e).__name__, "message": str(e)}
    except Exception as e:  # noqa: BLE001 - reported so the test shows what came instead
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


SAMPLED = dict(mode="sd", max_new_tokens=20, temperature=1.0, seed=5)


def main(out_dir: Path) -> dict:
    t0 = time.perf_counter()
    assert jax.device_count() == 8, jax.devices()
    target, draft = models()
    cfg = ParseConfig(**CONFIG, schedule="fixed")
    eng = ParseEngine(target, draft, cfg)
    ids = np.random.default_rng(1).integers(0, V, (8, 13))
    ref_logits = target.logits(ids)
    contexts, drafts, bounds = requests(np.random.default_rng(2))
    ref_scores = [eng.prefix_scores(c, d, b) for c, d, b in zip(contexts, drafts, bounds)]  # one pass each
    ref_gen = {mode: eng.generate(PROMPTS, mode=mode, max_new_tokens=20)
               for mode in ("target", "parse", "sd", "eagle3", "parse+eagle3")}
    out: dict = {"meshes": {}, "ref_parse_stats": {k: ref_gen["parse"].stats[k] for k in
                                                    ("accepted_per_request", "draft_tokens")}}
    ref_sampled = eng.generate(PROMPTS, **SAMPLED)
    out["seconds_reference"] = time.perf_counter() - t0
    # Orbax: save from 8 devices (mesh 2x4), restore here onto another layout; the caller restores on 2 and 1
    mesh24 = make_mesh({"data": 2, "model": 4})
    ckpt = save_model(shard_model(target, mesh24), out_dir / "ckpt")
    np.save(out_dir / "ref_logits.npy", ref_logits)
    np.save(out_dir / "ids.npy", ids)
    (out_dir / "ref_scores.json").write_text(json.dumps({
        "contexts": contexts, "drafts": drafts, "boundaries": bounds, "scores": [r.tolist() for r in ref_scores],
        "tokens_target": ref_gen["target"].tokens}))
    (out_dir / "ready").write_text("ok")  # the 2-process restore may start now, beside the mesh checks
    for d, m in MESHES:
        t1 = time.perf_counter()
        mesh = make_mesh({"data": d, "model": m})
        st = shard_model(target, mesh)
        sd = shard_model(draft, mesh) if (d, m) == DRAFT_SHARDED_ON else draft
        row: dict = {"q_proj_spec": str(st.params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec),
                     "down_proj_spec": str(st.params["layers_0"]["mlp"]["down_proj"]["kernel"].sharding.spec)}
        row["logits_max_diff"] = float(np.abs(st.logits(ids) - ref_logits).max())
        row["seconds_logits"] = time.perf_counter() - t1
        row["draft_sharded"] = isinstance(sd, ShardedModel)
        s_eng = ParseEngine(st, sd, cfg)
        row["cache_k_spec_batch3"] = str(st.init_cache(3, 64).k[0].sharding.spec)
        row["cache_k_spec_batch8"] = str(st.init_cache(8, 64).k[0].sharding.spec)
        # prefix scoring under shard_map over `data`: one request at a time through the sharded engine (padded to
        # the data axis), and the 3 requests in one pass (padded on data 2, 4, 8)
        row["prefix_scores_max_diff"] = scores_diff([s_eng.prefix_scores(c, d, b) for c, d, b in
                                                     zip(contexts, drafts, bounds)], ref_scores)
        row["batch_scores_max_diff"] = scores_diff(sharded_prefix_scores(s_eng, contexts, drafts, bounds),
                                                   ref_scores)
        row["seconds_verify"] = time.perf_counter() - t1
        for mode, ref in ref_gen.items():
            if (d, m) not in ALL_MODES_ON and mode not in ("target", "parse"):
                continue
            res = s_eng.generate(PROMPTS, mode=mode, max_new_tokens=20)
            row[f"{mode}_tokens_equal"] = res.tokens == ref.tokens
            row[f"{mode}_texts_equal"] = res.texts == ref.texts
            row[f"seconds_{mode}"] = time.perf_counter() - t1
        row["parse_accepted_per_request"] = res.stats["accepted_per_request"]  # parse's, or parse+eagle3's
        if (d, m) == (4, 2):  # the proposed decode.generate hook: prompt rows on `data` -> data-parallel decode
            out["shard_rows_4x2"] = rows_generate(target, st, mesh)
            # sampled: each row draws from its own key, whatever devices hold its rows
            out["sampled_sd_4x2_tokens_equal"] = s_eng.generate(PROMPTS, **SAMPLED).tokens == ref_sampled.tokens
        out["meshes"][f"{d}x{m}"] = row
    out["ref_tokens"] = {mode: r.tokens for mode, r in ref_gen.items()}
    mesh18 = make_mesh({"data": 1, "model": 8})
    t1 = time.perf_counter()
    back = load_sharded(ckpt, mesh18)
    out["restore_1x8"] = {
        "params_equal": params_equal(jax.tree.map(np.asarray, back.params), jax.tree.map(np.asarray, target.params)),
        "q_proj_spec": str(back.params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec),
        "q_proj_devices": len(back.params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.device_set),
        "q_proj_shard_shape": list(back.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
                                   .addressable_shards[0].data.shape),
        "logits_max_diff": float(np.abs(back.logits(ids) - ref_logits).max()),
    }
    out["seconds_orbax"] = time.perf_counter() - t1
    # bad input: configs, params as shapes (the checks run before any param is placed)
    def config(**kw):
        cfg = tiny_config("qwen3", **{**SHAPE, **kw})
        return Model(cfg, param_shapes(cfg), TOK)

    out["errors"] = {
        "mesh_size": error_of(lambda: make_mesh({"data": 3, "model": 2})),
        "mesh_too_small": error_of(lambda: make_mesh({"data": 2, "model": 2})),
        "kv_heads": error_of(lambda: shard_model(config(num_kv_heads=4), mesh18)),
        "heads": error_of(lambda: shard_model(config(num_heads=4, num_kv_heads=4), mesh18)),
        "mlp": error_of(lambda: shard_model(config(intermediate_size=100), mesh18)),
    }
    out["fallback_is_replicated"] = fitting_rules(config(num_heads=4, num_kv_heads=4).config, mesh18,
                                                       fallback_replicated=True) == ShardingRules.replicated()
    out["gqa_on_model_4_ok"] = error_of(lambda: abstract_params(config(num_kv_heads=4).config, mesh24))
    out["seconds"] = time.perf_counter() - t0
    return out


if __name__ == "__main__":
    jax.config.update("jax_disable_most_optimizations", True)
    folder = Path(sys.argv[1])
    (folder / "meshes.json").write_text(json.dumps(main(folder), indent=1))
