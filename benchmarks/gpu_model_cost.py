"""What a PARSE verification pass costs a real-sized target on this device, against the passes it replaces.

Random-weight models of real shapes: a Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, head dim 128,
intermediate 12288, vocab 151936, qk_norm, bfloat16) and a Qwen3-0.6B-shaped draft (28 layers, hidden 1024, 16/8
heads, intermediate 3072, tied embeddings). For each batch size, draft length D and prefix count K it times, on the
target, after a 512-token cached context:

  verify   one pass over the packed block: D draft tokens + K copies of a 16-token suffix (docs/design.md §2 layout,
           prefixes spread evenly), judge logits read at the K copy ends and next-token logits at the K boundaries;
  prefill  a plain causal pass over the same D draft tokens (the cost of reading the draft with no verification);
  decode   one target decode step (one token per row); and one draft decode step.

From these: verify / prefill (what K suffix copies add), verify / decode step, and the break-even: how many accepted
draft tokens pay for one verification plus drafting D tokens, counted in target decode steps
(`(verify + D * draft_step) / target_step`). Each timing is the median over repeats of a jitted loop of `--passes`
forwards (dispatch amortised; the token ids change every pass so nothing is loop-invariant), cache donated. All
passes of one batch size share one cache of S slots; the XLA attention path masks over all S slots, as the engine's
does. Params are drawn directly on the device in the model dtype (no float32 Flax init). Results are rewritten
after every measurement, so a timeout keeps what finished.

    python benchmarks/gpu_model_cost.py [--out DIR] [--budget-s 90]   # real shapes; an accelerator (~16 GB target)
    python benchmarks/gpu_model_cost.py --smoke            # tiny shapes on CPU in well under a minute

DIR defaults to $OUT, else benchmarks/results; writes DIR/gpu_model_cost.json and .md (smoke: gpu_model_cost_smoke.*).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from host_reference import pack, pad_blocks  # benchmarks/ is on sys.path when run as a script

from parse_jax.harness.provenance import provenance
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder, causal_metadata
from parse_jax.models.model import Model, init_params
from parse_jax.runtime.programs import forward_fn

TARGET = ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                     max_position_embeddings=40960, dtype="bfloat16")
DRAFT = ModelConfig(architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                    num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                    tie_word_embeddings=True, max_position_embeddings=40960, dtype="bfloat16")
SMOKE_TARGET = ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, dtype="float32")
SMOKE_DRAFT = SMOKE_TARGET.replace(num_layers=1, tie_word_embeddings=True)  # shares the target's leaf shapes
# most informative first: a run cut by its time budget still holds the middle of the grid at both batch sizes
FULL = dict(batches=(1, 16), draft_lens=(512, 256, 1024), ks=(16, 8, 32), suffix=16, context=512)
SMOKE = dict(batches=(1, 2), draft_lens=(24,), ks=(2, 4), suffix=4, context=16)


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random params of `cfg`'s tree, drawn on the default device directly in cfg.dtype (norm scales 1, the rest
    normal * 0.02): seconds for an 8B model, where Flax's float32 init would take minutes and twice the memory.
    One small jitted draw per distinct leaf shape (a single jit over the whole tree compiles slowly)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(lambda: init_params(cfg, seed)))
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        if getattr(path[-1], "key", None) == "scale":
            out.append(_ones(leaf.shape, leaf.dtype))
        else:
            out.append(_normal(jax.random.fold_in(key, i), leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
    return (jax.random.normal(key, shape, dtype) * 0.02).astype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ones(shape, dtype):
    return jnp.ones(shape, dtype)


@functools.cache
def _loop_program(cfg: ModelConfig, passes: int):
    """Jitted (params, cache, tokens, positions, limit, group, read) -> (cache, checksum): `passes` forwards of one
    block over the cache (written at the same slots each time), logits read at `read` [B, R] block indices."""
    module = Decoder(cfg)

    def run(params, cache, tokens, positions, limit, group, read):
        forward = forward_fn(module, params)

        def body(i, carry):
            cache, acc = carry
            ids = (tokens + i) % cfg.vocab_size  # changes every pass: nothing can be hoisted out of the loop
            logits, cache = forward(ids, positions, cache, limit, group)
            picked = jnp.take_along_axis(logits, read[..., None], axis=1)
            return cache, acc + picked.mean()

        return jax.lax.fori_loop(0, passes, body, (cache, jnp.float32(0)))

    return jax.jit(run, donate_argnums=(1,))


class Timer:
    """One model, one batch size, one cache of `slots` slots holding `context` committed tokens."""

    def __init__(self, model: Model, batch: int, slots: int, context: int, passes: int, repeats: int) -> None:
        self.model, self.batch, self.passes, self.repeats = model, batch, passes, repeats
        self.context = context
        self.cache = model.init_cache(batch, slots).commit(context)

    def seconds(self, tokens: np.ndarray, positions: np.ndarray, limit: np.ndarray, group: np.ndarray,
                read: np.ndarray) -> float:
        """Median seconds of ONE forward of the block (the loop's time / passes)."""
        program = _loop_program(self.model.config, self.passes)
        args = [jnp.asarray(np.broadcast_to(x, (self.batch, *x.shape[-1:])), jnp.int32)
                for x in (tokens, positions, limit, group, read)]
        times = []
        for r in range(self.repeats + 1):  # the first call compiles
            t0 = time.perf_counter()
            self.cache, acc = program(self.model.params, self.cache, *args)
            float(acc)  # wait for the device
            if r:
                times.append(time.perf_counter() - t0)
        return float(np.median(times)) / self.passes

    def decode_step(self) -> float:
        limit, group = causal_metadata(1, 1)
        return self.seconds(np.array([7]), np.array([self.context]), np.asarray(limit)[0], np.asarray(group)[0],
                            np.array([0]))

    def prefill(self, d: int) -> float:
        limit, group = causal_metadata(1, d)
        return self.seconds(np.arange(d) % 1000 + 1, self.context + np.arange(d), np.asarray(limit)[0],
                            np.asarray(group)[0], np.array([d - 1]))

    def verify(self, d: int, k: int, suffix: int) -> tuple[float, int]:
        bounds = sorted(set(np.linspace(d / k, d, k).round().astype(int).tolist()))
        blk = pack(self.context, np.arange(d) % 1000 + 1, bounds, np.arange(suffix) + 3)
        a = pad_blocks([blk], blk.length)
        read = np.concatenate([blk.score_index, blk.limit[blk.score_index] - 1])  # judge ends + boundary logits
        return self.seconds(a["tokens"][0], a["positions"][0], a["limit"][0], a["group"][0], read), blk.length


def measure(target: Model, draft: Model, batches, draft_lens, ks, suffix: int, context: int, repeats: int,
            passes: int, on_row=lambda rows: None, log=print, budget_s: float | None = None) -> list[dict]:
    """Every (D, K, batch) row, in the order given (most informative first: every batch size gets its first row
    before any gets its second); `on_row(rows)` after each, so partial results survive a timeout. With `budget_s`,
    no new measurement starts once that many seconds have passed."""
    start = time.monotonic()
    rows: list[dict] = []
    slots = -(-(context + max(draft_lens) + max(ks) * suffix + 1) // 128) * 128
    timers, steps, draft_steps, prefills = {}, {}, {}, {}

    def out_of_time() -> bool:
        if budget_s is not None and time.monotonic() - start > budget_s:
            log(f"budget of {budget_s:.0f} s spent: stopping after {len(rows)} row(s)")
            return True
        return False

    for d in draft_lens:
        for k in ks:
            for b in batches:
                if out_of_time():
                    return rows
                if b not in timers:  # lazily: the first row of batch 1 comes before batch 16's programs compile
                    timers[b] = Timer(target, b, slots, context, passes, repeats)
                    steps[b] = timers[b].decode_step()
                    draft_steps[b] = Timer(draft, b, slots, context, passes, repeats).decode_step()
                    log(f"batch {b}: target decode step {steps[b] * 1e3:.3f} ms, draft decode step "
                        f"{draft_steps[b] * 1e3:.3f} ms")
                t, step, draft_step = timers[b], steps[b], draft_steps[b]
                if (b, d) not in prefills:
                    prefills[b, d] = t.prefill(d)
                pre = prefills[b, d]
                ver, length = t.verify(d, k, suffix)
                row = {"batch": b, "draft_tokens": d, "K": k, "suffix": suffix, "context": context,
                       "block_tokens": length, "cache_slots": slots, "verify_ms": ver * 1e3, "prefill_ms": pre * 1e3,
                       "target_decode_step_ms": step * 1e3, "draft_decode_step_ms": draft_step * 1e3,
                       "verify_vs_prefill": ver / pre, "verify_vs_decode_step": ver / step,
                       "draft_step_vs_target_step": draft_step / step,
                       "break_even_accepted_tokens": (ver + d * draft_step) / step,
                       "elapsed_s": time.monotonic() - start}
                rows.append(row)
                log(f"  batch {b} D={d} K={k}: verify {ver * 1e3:.2f} ms = {ver / pre:.2f}x prefill "
                    f"({pre * 1e3:.2f} ms) = {ver / step:.1f} decode steps; break-even "
                    f"{row['break_even_accepted_tokens']:.1f} tokens")
                on_row(rows)
    return rows


def markdown(result: dict) -> str:
    t, d = result["target"], result["draft"]
    lines = [f"# Verification cost on {result['provenance']['device']} ({result['provenance']['device_kind']})", "",
             f"Command: `{result['command']}`", "",
             f"Target: {t['num_layers']} layers, hidden {t['hidden_size']}, "
             f"{t['num_heads']}/{t['num_kv_heads']} heads, "
             f"vocab {t['vocab_size']}, {t['dtype']} ({result['target_params_b']:.3g}B params, random weights). "
             f"Draft: {d['num_layers']} layers, hidden {d['hidden_size']} ({result['draft_params_b']:.3g}B). "
             f"Context {result['context']} cached tokens; suffix {result['suffix']} tokens per prefix; median of "
             f"{result['repeats']} repeats of {result['passes']} passes. Break-even: accepted draft tokens that pay "
             "for one verification plus drafting D tokens, in target decode steps.", "",
             "| batch | D | K | block tokens | verify ms | prefill ms | verify / prefill | verify / decode step | "
             "target step ms | draft step ms | break-even tokens |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["batch"], r["draft_tokens"], r["K"])):
        lines.append(f"| {r['batch']} | {r['draft_tokens']} | {r['K']} | {r['block_tokens']} | {r['verify_ms']:.2f} | "
                     f"{r['prefill_ms']:.2f} | {r['verify_vs_prefill']:.2f}x | {r['verify_vs_decode_step']:.1f}x | "
                     f"{r['target_decode_step_ms']:.3f} | {r['draft_decode_step_ms']:.3f} | "
                     f"{r['break_even_accepted_tokens']:.1f} |")
    p = result["provenance"]
    if not result.get("complete"):
        lines += ["", f"Incomplete: {len(result['rows'])} of "
                  f"{len(result['batches']) * len(result['draft_lens']) * len(result['ks'])} rows (time budget, "
                  "timeout, or still running)."]
    lines += ["", f"Commit {p['git_commit'][:12]}{' (uncommitted changes)' if p.get('git_dirty') else ''}; jax "
              f"{p['jax']}; {p['time_utc']}; parameter init {result['init_seconds']:.1f} s.", ""]
    return "\n".join(lines)


def run(smoke: bool, out: Path, repeats: int, passes: int, grid: dict, budget_s: float | None = None,
        log=print) -> dict:
    target_cfg, draft_cfg = (SMOKE_TARGET, SMOKE_DRAFT) if smoke else (TARGET, DRAFT)
    t0 = time.perf_counter()
    target = Model(target_cfg, random_params(target_cfg, 0))
    draft = Model(draft_cfg, random_params(draft_cfg, 1))
    jax.block_until_ready((target.params, draft.params))
    init_seconds = time.perf_counter() - t0
    log(f"params on {jax.devices()[0]} in {init_seconds:.1f} s")
    stem = "gpu_model_cost" + ("_smoke" if smoke else "")
    if tuple(grid["batches"]) != tuple((SMOKE if smoke else FULL)["batches"]):
        stem += "_b" + "-".join(str(b) for b in grid["batches"])  # split runs do not overwrite each other
    result = {"command": "python " + " ".join(sys.argv), "smoke": smoke, "target": target_cfg.to_dict(),
              "draft": draft_cfg.to_dict(), "target_params_b": target_cfg.num_params / 1e9,
              "draft_params_b": draft_cfg.num_params / 1e9, "repeats": repeats, "passes": passes,
              "init_seconds": init_seconds, **grid, "rows": [], "complete": False,
              "provenance": provenance({"grid": grid, "repeats": repeats, "passes": passes, "smoke": smoke}, 0)}
    out.mkdir(parents=True, exist_ok=True)

    def save(rows):
        result["rows"] = rows
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"{stem}.md").write_text(markdown(result))

    save([])
    rows = measure(target, draft, grid["batches"], grid["draft_lens"], grid["ks"], grid["suffix"], grid["context"],
                   repeats, passes, on_row=save, log=log, budget_s=budget_s)
    result["complete"] = len(rows) == len(grid["batches"]) * len(grid["draft_lens"]) * len(grid["ks"])
    save(rows)
    log(f"wrote {out / stem}.json and .md")
    return result


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, seconds): checks the script, not a GPU")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (smoke: 2)")
    ap.add_argument("--passes", type=int, default=None, help="forwards per timed jitted loop; default 4 (smoke: 2)")
    ap.add_argument("--batches", type=_ints, default=None, help="e.g. 1,16")
    ap.add_argument("--draft-lens", type=_ints, default=None, help="e.g. 256,512,1024")
    ap.add_argument("--ks", type=_ints, default=None, help="e.g. 8,16,32")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new measurement after this many seconds")
    a = ap.parse_args()
    grid = dict(SMOKE if a.smoke else FULL)
    for key in ("batches", "draft_lens", "ks"):
        if getattr(a, key):
            grid[key] = getattr(a, key)
    if not a.smoke and jax.devices()[0].platform == "cpu":
        print("warning: real shapes on a CPU take hours; use --smoke", file=sys.stderr)
    run(a.smoke, Path(a.out), a.repeats or (2 if a.smoke else 5), a.passes or (2 if a.smoke else 4), grid, a.budget_s)


if __name__ == "__main__":
    main()
