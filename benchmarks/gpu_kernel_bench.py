"""The GPU kernel against the XLA path and dense masked attention, at Qwen3-8B head shapes.

Per case (cache C, draft D, K suffix copies of 16 tokens, one request): the fraction of non-empty tiles,
the kernel's time against the same kernel doing every tile ("dense work"), against the XLA path with the same
metadata, and against `jax.nn.dot_product_attention` with an explicit dense mask (cuDNN when it accepts the
call, XLA otherwise); TFLOP/s on the non-empty tiles against this machine's measured bf16 matmul rate; and the
kernel's max abs error against the reference. Median of repeats, `block_until_ready`, one process.

    python benchmarks/gpu_kernel_bench.py --out out/gpu_check/kernel_bench      # on a GPU (about 4 minutes)
    python benchmarks/gpu_kernel_bench.py --smoke --out /tmp/smoke               # CPU, interpret mode, tiny

Depends on jax, numpy and `pallas_kernels` only (so it runs where parse_jax's other dependencies are absent).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

from pallas_kernels import attention_reference, visibility  # noqa: E402
from pallas_kernels.block_map import key_block_ranges, tile_counts  # noqa: E402
from pallas_kernels.gpu import attention_gpu, gpu_block_q  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Heads:
    heads: int = 32      # Qwen3-8B
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Case:
    cache: int    # context tokens already in the cache
    draft: int
    k: int        # prefixes = suffix copies
    suffix: int = 16

    @property
    def tokens(self) -> int:
        return self.draft + self.k * self.suffix


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_q: int = 64
    block_k: int = 64
    num_warps: int | None = None
    num_stages: int = 2


# Most telling first: if the time budget runs out, the cases left out are the least informative.
FULL_CASES = [Case(2048, 1024, 16), Case(0, 2048, 64), Case(8192, 4096, 16), Case(0, 512, 8), Case(2048, 4096, 32),
              Case(8192, 1024, 32), Case(0, 1024, 16), Case(2048, 1024, 64), Case(8192, 2048, 32), Case(0, 4096, 8),
              Case(2048, 2048, 16), Case(8192, 4096, 64),
              Case(8192, 1, 0), Case(8192, 4096, 0)]  # one decode step and a plain causal prefill (K = 0)
TUNE_CASE = Case(2048, 2048, 32)
TUNE_CONFIGS = [KernelConfig(64, 64), KernelConfig(128, 64, 8, 2), KernelConfig(128, 128, 8, 2),
                KernelConfig(64, 32, 4, 3), KernelConfig(128, 64, 8, 3)]
SMOKE_CASES = [Case(30, 40, 4, 4), Case(30, 32, 8, 3)]  # one shape (T 56, S 86): one compilation
SMOKE_HEADS = Heads(4, 2, 64, "float32")


def packed_metadata(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """limit, group [T] of docs/design.md §2 for evenly spaced boundaries (the last is the whole draft); the same
    arrays as `tests/verify/layout_reference.py: pack` (a test checks it) without importing parse_jax's dependencies.
    K = 0 is a plain causal block (draft = 1: one decode step over the cache)."""
    if case.k == 0:
        return np.arange(1, case.draft + 1, dtype=np.int32), np.zeros(case.draft, np.int32)
    bounds = np.linspace(case.draft / case.k, case.draft, case.k).round().astype(np.int32)
    limit = np.concatenate([np.arange(1, case.draft + 1), np.repeat(bounds, case.suffix)]).astype(np.int32)
    group = np.concatenate([np.zeros(case.draft), np.repeat(np.arange(1, case.k + 1), case.suffix)]).astype(np.int32)
    return limit, group


def median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_tflops(n: int, repeats: int) -> float:
    """This machine's bf16 matrix rate: an n x n x n matmul, float32 accumulation, bf16 output."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / median_seconds(fn, (a, b), repeats) / 1e12


def make_inputs(case: Case, heads: Heads, seed: int = 0):
    limit, group = packed_metadata(case)
    t, s = case.tokens, case.cache + case.tokens
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    dtype = jnp.dtype(heads.dtype)
    q = jax.random.normal(keys[0], (1, t, heads.heads, heads.head_dim), dtype)
    k = jax.random.normal(keys[1], (1, heads.kv_heads, s, heads.head_dim), dtype)
    v = jax.random.normal(keys[2], (1, heads.kv_heads, s, heads.head_dim), dtype)
    return q, k, v, jnp.array([case.cache], jnp.int32), jnp.asarray(limit[None]), jnp.asarray(group[None])


@functools.cache
def kernel_fn(cfg: KernelConfig, interpret: bool):
    return jax.jit(lambda q, k, v, lengths, limit, group: attention_gpu(
        q, k, v, lengths, limit, group, block_q=cfg.block_q, block_k=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, interpret=interpret))


@functools.cache
def dense_masked_fn(implementation: str | None):
    """`jax.nn.dot_product_attention` with the dense [T, S] mask as an input (built outside the timing)."""
    return jax.jit(lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask,
                                                                      implementation=implementation))


def tile_fraction(case: Case, cfg: KernelConfig, limit, group) -> tuple[float, int]:
    """(visited / all tiles, visited tiles) of the kernel's block map for this case."""
    bq = gpu_block_q(case.tokens, cfg.block_q)
    slots = case.cache + case.tokens
    ranges = jax.jit(key_block_ranges, static_argnums=(3, 4, 5))(jnp.array([case.cache]), limit, group, slots, bq,
                                                                  cfg.block_k)
    visited, total = tile_counts(ranges, -(-slots // cfg.block_k))
    return int(visited) / total, int(visited)


def run_case(case: Case, heads: Heads, cfg: KernelConfig, repeats: int, interpret: bool, matmul_rate: float,
             dense_impls: list[str | None]) -> dict:
    q, k, v, lengths, limit, group = make_inputs(case, heads)
    t, s = case.tokens, case.cache + case.tokens
    row: dict = {"cache": case.cache, "draft": case.draft, "k": case.k, "suffix": case.suffix, "tokens": t,
                 "slots": s}
    kernel = kernel_fn(cfg, interpret)
    out = kernel(q, k, v, lengths, limit, group)
    ref = jax.jit(attention_reference)(q, k, v, lengths, limit, group)
    row["max_abs_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]  # the exact answer, for the rounding of bf16 itself
    ref32 = jax.jit(attention_reference)(*f32, lengths, limit, group)
    row["max_abs_err_vs_f32"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref32)))
    row["ref_max_abs_err_vs_f32"] = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - ref32)))
    row["finite"] = bool(jnp.isfinite(out).all())
    del out, ref, ref32, f32
    fraction, visited = tile_fraction(case, cfg, limit, group)
    row["tile_fraction"] = fraction
    row["kernel_s"] = median_seconds(kernel, (q, k, v, lengths, limit, group), repeats)
    # Dense work: the same kernel where every query sees every key (every tile visited, no mask to build).
    everything = jnp.full_like(limit, t), jnp.zeros_like(group)
    row["kernel_dense_work_s"] = median_seconds(kernel, (q, k, v, lengths, *everything), repeats)
    row["time_ratio_vs_dense_work"] = row["kernel_s"] / row["kernel_dense_work_s"]
    row["proportionality"] = row["time_ratio_vs_dense_work"] / fraction  # target <= 1.3
    row["xla_s"] = median_seconds(jax.jit(attention_reference), (q, k, v, lengths, limit, group), repeats)
    mask = jax.jit(visibility, static_argnums=3)(lengths, limit, group, s)[:, None]  # [B, 1, T, S]
    k_bshd, v_bshd = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # its layout: [B, S, KV, D]
    for impl in dense_impls:
        try:
            row["dense_masked_s"] = median_seconds(dense_masked_fn(impl), (q, k_bshd, v_bshd, mask), repeats)
            row["dense_masked_impl"] = impl or "default"
            break
        except Exception as e:  # cuDNN may refuse a shape or mask: fall back to the next implementation
            row.setdefault("dense_masked_errors", []).append(f"{impl}: {type(e).__name__}: {str(e)[:200]}")
    if "dense_masked_s" in row:
        row["speedup_vs_dense_masked"] = row["dense_masked_s"] / row["kernel_s"]
    bq = gpu_block_q(t, cfg.block_q)
    flops = 4 * bq * cfg.block_k * heads.head_dim * visited * heads.heads
    row["tflops_nonempty"] = flops / row["kernel_s"] / 1e12
    row["fraction_of_matmul_rate"] = row["tflops_nonempty"] / matmul_rate if matmul_rate else None
    row["speedup_vs_xla"] = row["xla_s"] / row["kernel_s"]
    return row


def tune(heads: Heads, repeats: int, interpret: bool, configs: list[KernelConfig], case: Case) -> tuple[KernelConfig,
                                                                                                         list]:
    """The fastest of a few block configurations on one mid-size case (each one compiles once)."""
    q, k, v, lengths, limit, group = make_inputs(case, heads)
    rows = []
    for cfg in configs:
        try:
            seconds = median_seconds(kernel_fn(cfg, interpret), (q, k, v, lengths, limit, group), repeats)
            rows.append({**dataclasses.asdict(cfg), "kernel_s": seconds})
        except Exception as e:
            rows.append({**dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    timed = [r for r in rows if "kernel_s" in r]
    if not timed:
        return KernelConfig(), rows
    best = min(timed, key=lambda r: r["kernel_s"])
    return KernelConfig(best["block_q"], best["block_k"], best["num_warps"], best["num_stages"]), rows


def markdown(report: dict) -> str:
    lines = [f"# Multi-prefix attention kernel: {report['device']}", "",
             f"jax {report['jax']}, heads {report['heads']}, kernel config {report['kernel_config']}, "
             f"measured bf16 matmul rate {report['matmul_tflops']:.3g} TFLOP/s, median of {report['repeats']}.",
             "", "| cache | draft | K | T | tiles | kernel ms | dense-work ms | ratio/tiles (<=1.3) | XLA ms | "
             "dense masked ms (impl) | vs dense (>=2 at K>=16) | TFLOP/s (of matmul) | max err (vs f32; ref vs f32) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["cases"]:
        if "error" in r:
            lines.append(f"| {r['cache']} | {r['draft']} | {r['k']} | | error: {r['error'][:80]} |"
                         " | | | | | | | |")
            continue
        dense = (f"{r['dense_masked_s'] * 1e3:.2f} ({r['dense_masked_impl']})" if "dense_masked_s" in r else "failed")
        vs = f"{r['speedup_vs_dense_masked']:.2f}x" if "speedup_vs_dense_masked" in r else "-"
        frac = r["fraction_of_matmul_rate"]
        lines.append(
            f"| {r['cache']} | {r['draft']} | {r['k']} | {r['tokens']} | {r['tile_fraction']:.3f} | "
            f"{r['kernel_s'] * 1e3:.2f} | {r['kernel_dense_work_s'] * 1e3:.2f} | {r['proportionality']:.2f} | "
            f"{r['xla_s'] * 1e3:.2f} | {dense} | {vs} | {r['tflops_nonempty']:.3g} "
            f"({'-' if frac is None else f'{frac:.0%}'}) | {r['max_abs_err']:.1e} ({r['max_abs_err_vs_f32']:.1e}; "
            f"{r['ref_max_abs_err_vs_f32']:.1e}) |")
    if report.get("skipped"):
        lines += ["", f"Skipped for the time budget: {report['skipped']}"]
    if report.get("tuning"):
        lines += ["", "Block configurations tried (case " + str(report["tune_case"]) + "):", ""]
        lines += [f"- {r}" for r in report["tuning"]]
    lines += ["", "Targets: ratio/tiles <= 1.3 (time in proportion to the non-empty tiles); "
              ">= 2x vs the dense masked baseline at K >= 16; max err <= 2e-2 (bf16). The bf16 reference rounds "
              "its probabilities to bf16 too: the float32 columns show how far each is from the exact answer.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes: proves it runs")
    ap.add_argument("--out", default="out/gpu_check/kernel_bench", help="folder for results.json and results.md")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this long")
    ap.add_argument("--no-tune", action="store_true", help="skip the block-size sweep; use the default blocks")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    interpret = args.smoke or jax.default_backend() != "gpu"
    if interpret and not args.smoke:
        print("no GPU backend: running the smoke configuration in interpret mode", file=sys.stderr)
    smoke = args.smoke or interpret
    heads = SMOKE_HEADS if smoke else Heads()
    cases = SMOKE_CASES if smoke else FULL_CASES
    repeats = args.repeats or (1 if smoke else 10)
    cfg = KernelConfig(16, 16) if smoke else KernelConfig()
    dense_impls = ["xla"] if smoke else ["cudnn", "xla"]
    device = jax.devices()[0]
    report: dict = {"device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__,
                    "python": platform.python_version(), "smoke": smoke, "interpret": interpret,
                    "heads": dataclasses.asdict(heads), "repeats": repeats, "cases": [], "skipped": []}
    report["matmul_tflops"] = matmul_tflops(256 if smoke else 8192, repeats)
    if not (smoke or args.no_tune):
        cfg, report["tuning"] = tune(heads, repeats, interpret, TUNE_CONFIGS, TUNE_CASE)
        report["tune_case"] = dataclasses.asdict(TUNE_CASE)
    report["kernel_config"] = dataclasses.asdict(cfg)
    for case in cases:
        if time.perf_counter() - started > args.budget_s:
            report["skipped"].append(dataclasses.asdict(case))
            continue
        try:
            row = run_case(case, heads, cfg, repeats, interpret, report["matmul_tflops"], dense_impls)
        except Exception as e:  # one failing case must not cost the others
            traceback.print_exc()
            row = {**dataclasses.asdict(case), "error": f"{type(e).__name__}: {str(e)[:500]}"}
        report["cases"].append(row)
        print(json.dumps(row), flush=True)
    report["seconds"] = time.perf_counter() - started
    report["command"] = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "results.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
