"""On real devices (a GPU host, a TPU slice; or fake CPU devices for a smoke run): sharded == unsharded, and the
time of one verification pass per mesh.

1. Correctness, float32 at "highest" matmul precision: a random model (heads and KV heads divisible by every
   model axis tried) on each (data, model) mesh of the devices against the same model on one device: logits,
   the shard_map verification pass (scores, boundary logits, cache), greedy `ParseEngine.generate` tokens
   (modes target and parse).
2. Timing, default precision, `--dtype` (bfloat16 by default): one verification pass (batch `--batch`, a
   `--draft` token draft with `--prefixes` suffix copies) of a larger random model, median of `--repeats`, on
   one device and sharded under each mesh (GSPMD `verify_pass` and the shard_map `sharded_verify_pass`).

    python benchmarks/multidevice_check.py [--out benchmarks/results/multidevice_check] [--layers 16 ...]
    # multi-host (TPU pod slice, GPU cluster): add --distributed, or --coordinator/--num-processes/--process-id
See benchmarks/multidevice_check.sh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from host_reference import pack, sharded_verify_pass, verify_pass  # benchmarks/ is on sys.path as a script

from parse_jax.distributed.args import add_distributed_args
from parse_jax.distributed.mesh import make_mesh
from parse_jax.distributed.multihost import initialize_from_args, is_writer
from parse_jax.distributed.sharded import shard_model
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.harness.provenance import provenance
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model, init_params
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.runtime.programs import bucket, to_host
from parse_jax.tasks import TOKENIZER_DIR


def meshes(n: int, kv_heads: int) -> list[tuple[int, int]]:
    return [(n // m, m) for m in range(1, n + 1) if n % m == 0 and kv_heads % m == 0]


IMPL = "xla"  # --attention-impl: the attention kernel every model here uses


def random_model(cfg: ModelConfig, seed: int, tokenizer=None) -> Model:
    params = init_params(cfg, seed)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), params)
    return Model(cfg, jax.device_put(params, jax.devices()[0]), tokenizer, IMPL)


def max_diff(a, b) -> float:
    a, b = to_host(a), to_host(b)
    both = ~(np.isnan(a) & np.isnan(b))
    return float(np.abs(a[both] - b[both]).max())


def correctness(n: int, heads: int) -> dict:
    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    shape = dict(vocab_size=tok.vocab_size, hidden_size=16 * heads, intermediate_size=32 * heads, num_heads=heads,
                 num_kv_heads=heads, head_dim=16, num_layers=2, max_position_embeddings=512)
    target = random_model(ModelConfig(architecture="qwen3", qk_norm=True, **shape), 0, tok)
    draft = random_model(ModelConfig(architecture="llama", **{**shape, "num_layers": 1}), 1, tok)
    cfg = ParseConfig(max_draft_tokens=16, segmenter="stride", stride=4, schedule="fixed")
    eng = ParseEngine(target, draft, cfg)
    prompts = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :"]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, tok.vocab_size, (2 * n, 24))
    blocks = [pack(0, rng.integers(0, tok.vocab_size, 20).tolist(), [5, 12, 20], eng.suffix_ids) for _ in range(3)]
    ref_logits = target.logits(ids)
    ref_v = verify_pass(target, target.init_cache(3, 128), blocks, eng.yes_id, eng.no_id, 64, 4, [2, 3, 4])
    ref_gen = {m: eng.generate(prompts, mode=m, max_new_tokens=32).tokens for m in ("target", "parse")}
    out = {}
    for d, m in meshes(n, heads):
        mesh = make_mesh({"data": d, "model": m})
        st, sd = shard_model(target, mesh), shard_model(draft, mesh)
        v = sharded_verify_pass(st, st.init_cache(3, 128), blocks, eng.yes_id, eng.no_id, 64, 4, [2, 3, 4])
        s_eng = ParseEngine(st, sd, cfg)
        row = {"logits_max_diff": max_diff(st.logits(ids), ref_logits),
               "verify_scores_max_diff": max_diff(v.scores, ref_v.scores),
               "verify_boundary_logits_max_diff": max_diff(v.boundary_logits, ref_v.boundary_logits),
               "verify_cache_max_diff": max(max_diff(a, b) for a, b in zip(v.cache.k + v.cache.v,
                                                                           ref_v.cache.k + ref_v.cache.v))}
        for mode, ref in ref_gen.items():
            row[f"{mode}_tokens_equal"] = s_eng.generate(prompts, mode=mode, max_new_tokens=32).tokens == ref
        out[f"data={d},model={m}"] = row
    return out


def median_ms(setup, fn, repeats: int) -> float:
    """Median time of `fn(setup())`, `setup` untimed (the cache is donated, so each call gets a fresh one)."""
    jax.block_until_ready(fn(setup()))  # compile
    times = []
    for _ in range(repeats):
        arg = jax.block_until_ready(setup())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def timing(a, n: int) -> dict:
    cfg = ModelConfig(architecture="qwen3", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                      qk_norm=True, max_position_embeddings=8192, dtype=a.dtype)
    model = random_model(cfg, 2)
    rng = np.random.default_rng(1)
    suffix = rng.integers(0, a.vocab, 12).tolist()
    bounds = np.linspace(0, a.draft, a.prefixes + 1).round().astype(int)[1:].tolist()
    blocks = [pack(a.context, rng.integers(0, a.vocab, a.draft).tolist(), bounds, suffix) for _ in range(a.batch)]
    length = bucket(max(b.length for b in blocks))
    cache_len = bucket(a.context + length)

    def run(m, verify) -> float:
        lengths = np.full(a.batch, a.context, np.int32)
        return median_ms(lambda: m.init_cache(a.batch, cache_len).set_lengths(lengths),
                         lambda cache: verify(m, cache, blocks, 1, 2, length, a.prefixes).boundary_logits, a.repeats)

    out = {"block_tokens": length, "one_device_ms": run(model, verify_pass), "meshes": {}}
    for d, m in meshes(n, a.kv_heads):
        if a.heads % m or (3 * a.hidden) % m:
            continue
        mesh = make_mesh({"data": d, "model": m})
        sm = shard_model(model, mesh)
        out["meshes"][f"data={d},model={m}"] = {"gspmd_verify_pass_ms": run(sm, verify_pass),
                                                "shard_map_verify_ms": run(sm, sharded_verify_pass)}
    return out


def main() -> None:
    ap = add_distributed_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--draft", type=int, default=128)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--attention-impl", default="xla", help="attention kernel (see pallas_kernels.IMPLS)")
    ap.add_argument("--out", default="benchmarks/results/multidevice_check")
    a = ap.parse_args()
    global IMPL
    IMPL = a.attention_impl
    initialize_from_args(a)  # the meshes below are built here; --mesh is not used
    n = jax.device_count()
    if n < 2:
        sys.exit(f"needs at least 2 devices, found {n}: {jax.devices()}")
    t0 = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        check = correctness(n, heads=max(m for m in range(1, n + 1) if n % m == 0 and m <= 16))
    print(json.dumps(check), flush=True)
    bad = {k: v for k, v in check.items() if not (all(x <= a.tol for key, x in v.items() if key.endswith("diff"))
                                                  and v["target_tokens_equal"] and v["parse_tokens_equal"])}
    result = {"correctness": check, "correctness_ok": not bad, "tolerance": a.tol, "timing": timing(a, n),
              "seconds": time.perf_counter() - t0, "command": "python " + " ".join(sys.argv),
              "provenance": provenance(vars(a))}
    if is_writer():
        out = Path(f"{a.out}_{jax.devices()[0].platform}")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    if bad:
        sys.exit(f"sharded != unsharded on: {sorted(bad)}")


if __name__ == "__main__":
    main()
