"""Per-device memory of params and KV cache under each (data, model) mesh of 8 devices, by abstract evaluation.

Nothing is allocated for the large config: the param tree comes from `jax.eval_shape`, the cache's from
`jax.eval_shape(KVCache.init)`, and each array's per-device bytes from its NamedSharding's `shard_shape`
(`parse_jax.distributed`'s rules). For the embedded pair, the figures are also checked against real placement
(the sum of each device's addressable shards after `shard_model`).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/distributed_memory.py \\
        [--batch 8 --cache-len 8192] [--out benchmarks/results/distributed_memory]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import parse_jax as pj  # noqa: E402
from parse_jax.distributed.mesh import make_mesh
from parse_jax.distributed.sharded import shard_model
from parse_jax.errors import ConfigError  # noqa: E402
from parse_jax.harness.provenance import provenance  # noqa: E402
from parse_jax.models.cache import KVCache  # noqa: E402
from parse_jax.models.config import ModelConfig  # noqa: E402
from parse_jax.models.model import expected_params  # noqa: E402
from parse_jax.models.sharding import ShardingRules, abstract_params, cache_shardings

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
GIB = 1024 ** 3

QWEN3_8B = ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
                       rope_theta=1000000.0, max_position_embeddings=40960, dtype="bfloat16")


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (abstract arrays) placed by `shardings` (even shards: every device the same)."""
    return sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True))


def total_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def measure(cfg: ModelConfig, batch: int, cache_len: int, rules: ShardingRules | None = None) -> dict:
    cache = jax.eval_shape(lambda: KVCache.init(cfg, batch, cache_len))
    out = {"params_total_gib": total_bytes(expected_params(cfg)) / GIB, "cache_total_gib": total_bytes(cache) / GIB,
           "meshes": {}}
    for d, m in MESHES:
        mesh = make_mesh({"data": d, "model": m})
        key = f"data={d},model={m}"
        try:
            abstract = abstract_params(cfg, mesh, rules)
        except ConfigError as e:
            out["meshes"][key] = {"error": str(e)}
            continue
        p = per_device_bytes(abstract, jax.tree.map(lambda x: x.sharding, abstract))
        c = per_device_bytes(cache, cache_shardings(cfg, mesh, batch, rules))
        out["meshes"][key] = {"params_gib": p / GIB, "cache_gib": c / GIB, "total_gib": (p + c) / GIB}
    return out


def placed_bytes(model, mesh) -> int:
    """Largest per-device total of the params actually placed by `shard_model` (checks the abstract figures)."""
    placed = shard_model(model, mesh)
    per_device: dict[int, int] = {}
    for x in jax.tree.leaves(placed.params):
        for shard in x.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return max(per_device.values())


def markdown(result: dict, command: str) -> str:
    lines = [f"Per-device memory on {len(jax.devices())} devices ({jax.devices()[0].platform}, fake), by abstract "
             "evaluation (`jax.eval_shape` + `NamedSharding.shard_shape`; nothing allocated). Params: heads, KV heads, "
             "MLP hidden and vocab on `model`; cache rows on `data`, KV heads on `model`.", ""]
    for name, r in result["models"].items():
        unit, scale = ("GiB", 1) if r["params_total_gib"] + r["cache_total_gib"] >= 1 else ("MiB", 1024)
        lines += [f"### {name}", "", r["what"], "",
                  f"Unsharded: params {r['params_total_gib'] * scale:.3f} {unit}, KV cache "
                  f"{r['cache_total_gib'] * scale:.3f} {unit}.", "",
                  f"| mesh | params / device ({unit}) | KV cache / device ({unit}) | total / device ({unit}) |",
                  "|---|---|---|---|"]
        for mesh, row in r["meshes"].items():
            if "error" in row:
                lines.append(f"| {mesh} | not shardable: {row['error']} | | |")
            else:
                lines.append(f"| {mesh} | {row['params_gib'] * scale:.3f} | {row['cache_gib'] * scale:.3f} | "
                             f"{row['total_gib'] * scale:.3f} |")
        if "placed_check" in r:
            lines += ["", "Real placement (sum of one device's addressable shards) equals the abstract figure: "
                      + ", ".join(f"{k}: {v}" for k, v in r["placed_check"].items())]
        lines.append("")
    lines.append(f"Command: `{command}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache-len", type=int, default=8192)
    ap.add_argument("--pair-batch", type=int, default=16)
    ap.add_argument("--pair-cache-len", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/distributed_memory")
    a = ap.parse_args()
    if jax.device_count() != 8:
        sys.exit(f"needs 8 devices (fake CPU devices are set up when XLA_FLAGS is unset); found {jax.device_count()}")
    models = {"Qwen3-8B-shaped (bfloat16)": (QWEN3_8B, a.batch, a.cache_len, None,
                                             f"36 layers, hidden 4096, 32/8 heads, head dim 128, MLP 12288, vocab "
                                             f"151936; cache batch {a.batch} x {a.cache_len} tokens.")}
    target, draft = pj.load_pair()
    for role, m in (("target", target), ("draft", draft)):
        c = m.config
        what = (f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads, MLP "
                f"{c.intermediate_size}, vocab {c.vocab_size}, {c.dtype}; cache batch {a.pair_batch} x "
                f"{a.pair_cache_len}.")
        models[f"embedded pair: {role}"] = (c, a.pair_batch, a.pair_cache_len, None, what)
        models[f"embedded pair: {role}, replicated params"] = (c, a.pair_batch, a.pair_cache_len,
                                                                ShardingRules.replicated(),
                                                                what + " `ShardingRules.replicated()`: params on every "
                                                                "device, cache rows still split over `data`.")
    result = {"models": {}}
    for name, (cfg, batch, cache_len, rules, what) in models.items():
        result["models"][name] = {"what": what, **measure(cfg, batch, cache_len, rules)}
    for role, m in (("target", target), ("draft", draft)):
        r = result["models"][f"embedded pair: {role}"]
        check = {}
        for d, mm in MESHES:
            key = f"data={d},model={mm}"
            if "error" not in r["meshes"][key]:
                real = placed_bytes(m, make_mesh({"data": d, "model": mm}))
                abstract = round(r["meshes"][key]["params_gib"] * GIB)
                check[key] = "equal" if real == abstract else f"DIFFERS: placed {real} B vs abstract {abstract} B"
        r["placed_check"] = check
    command = ("XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/distributed_memory.py "
               + " ".join(sys.argv[1:])).strip()
    result["command"] = command
    result["provenance"] = provenance({"batch": a.batch, "cache_len": a.cache_len, "pair_batch": a.pair_batch,
                                       "pair_cache_len": a.pair_cache_len})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result, command))
    print(markdown(result, command))


if __name__ == "__main__":
    main()
