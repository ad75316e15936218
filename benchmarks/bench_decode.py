"""Target-only decoding cost on this machine: the jitted while-loop vs a Python loop over a jitted step,
and the cost of one forward over a block of T new tokens relative to T = 1 (PARSE's cost model).

    python benchmarks/bench_decode.py [--out benchmarks/results/decode.json] [--repeats 5]

Median of repeats; ratios are taken in the same process. Writes JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import causal_metadata
from parse_jax.models.model import Model, decoder_fn, init_params
from parse_jax.runtime.decode import generate

CONFIGS = {
    # The issue's ~20M-parameter config: per-step cost is bound by reading the weights.
    "20m": ModelConfig(architecture="llama", vocab_size=8192, hidden_size=512, intermediate_size=1024,
                       num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=4096),
    # The embedded draft's shape (configs/pair_default.yaml): tens of microseconds per step (dispatch overhead shows).
    "draft": ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, max_position_embeddings=4096),
    # The embedded target's size class.
    "1m": ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=384,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096),
}


def median_seconds(fn, repeats: int) -> float:
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def python_loop_decode(model: Model, prompt: np.ndarray, new_tokens: int):
    """The baseline: Python calls a jitted one-token step per token (device-resident token, no sync)."""
    cfg = model.config
    b, p = prompt.shape
    fwd = decoder_fn(cfg, model.attention_impl)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(params, token, cache):
        limit, group = causal_metadata(b, 1)
        logits, cache, _ = fwd.__wrapped__(params, token[:, None], cache.lengths[:, None], cache, limit, group)
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache.commit(1)

    @jax.jit
    def prefill(params, prompt):
        cache = model.init_cache(b, p + new_tokens)
        limit, group = causal_metadata(b, p)
        pos = jnp.broadcast_to(jnp.arange(p), (b, p))
        logits, cache, _ = fwd.__wrapped__(params, prompt, pos, cache, limit, group)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache.commit(p)

    def run():
        tok, cache = prefill(model.params, prompt)
        out = [tok]
        for _ in range(new_tokens - 1):
            tok, cache = step(model.params, tok, cache)
            out.append(tok)
        return np.asarray(jnp.stack(out, 1))

    return run


def block_cost(model: Model, t: int, context: int, repeats: int, passes: int = 8) -> float:
    """Seconds of one forward over a block of t new tokens after `context` cached ones.

    `passes` forwards run inside one jitted fori_loop (the block is rewritten at the same slots each time),
    so dispatch and cache copies are amortised the way they are in a decode loop.
    """
    cfg = model.config
    fwd = decoder_fn(cfg, model.attention_impl).__wrapped__
    tokens = jnp.asarray(np.random.default_rng(t).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
    pos = context + jnp.arange(t, dtype=jnp.int32)[None]
    limit, group = causal_metadata(1, t)

    @jax.jit
    def run(params):
        cache = model.init_cache(1, context + t).commit(context)

        def body(_, carry):
            cache, acc = carry
            logits, cache, _ = fwd(params, tokens, pos, cache, limit, group)
            return cache, acc + logits[0, -1, 0]

        return jax.lax.fori_loop(0, passes, body, (cache, jnp.float32(0)))[1]

    return median_seconds(lambda: run(model.params).block_until_ready(), repeats) / passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(CONFIGS), default="20m")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/decode_SIZE.json")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    config = CONFIGS[args.size]
    out = Path(args.out or f"benchmarks/results/decode_{args.size}.json")
    model = Model(config, init_params(config, 0))
    rng = np.random.default_rng(0)
    rows = {}
    for batch in (1, 8):
        prompt = rng.integers(0, config.vocab_size, (batch, 32)).astype(np.int32)
        # min_new == max_new and no EOS in a random config's ids: every row makes exactly new_tokens.
        rows_in = list(prompt)
        jitted = median_seconds(lambda r=rows_in: generate(model, r, max_new_tokens=args.new_tokens), args.repeats)
        python = median_seconds(python_loop_decode(model, prompt, args.new_tokens), args.repeats)
        a = generate(model, list(prompt), max_new_tokens=args.new_tokens).tokens
        b = python_loop_decode(model, prompt, args.new_tokens)().tolist()
        rows[batch] = {"jitted_loop_tokens_per_s": batch * args.new_tokens / jitted,
                       "jitted_loop_ms_per_step": jitted / args.new_tokens * 1e3,
                       "weight_read_gb_per_s": config.num_params * 4 * args.new_tokens / jitted / 1e9,
                       "python_loop_tokens_per_s": batch * args.new_tokens / python,
                       "speedup_jitted_vs_python": python / jitted, "same_tokens": a == b}
        print(f"batch {batch}: {rows[batch]}", flush=True)
    block = {}
    for t in (1, 16, 64, 256, 1024):
        block[t] = block_cost(model, t, context=128, repeats=args.repeats)
        print(f"T={t}: {block[t] * 1e3:.2f} ms ({block[t] / block[1]:.1f}x T=1)", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python " + " ".join(sys.argv),
        "config": config.to_dict(), "params_millions": config.num_params / 1e6,
        "new_tokens": args.new_tokens, "prompt_tokens": 32, "repeats": args.repeats,
        "decode": rows,
        "block_forward_ms": {t: s * 1e3 for t, s in block.items()},
        "block_forward_relative_to_T1": {t: s / block[1] for t, s in block.items()},
        "block_context_tokens": 128,
        "git_commit": commit, "jax": jax.__version__, "device": str(jax.devices()[0]),
        "machine": f"{platform.machine()} {platform.processor()} cores={__import__('os').cpu_count()}",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    md = [f"# Target-only decoding, {config.num_params / 1e6:.2f}M-param random llama config\n",
          f"Command: `{result['command']}` (median of {args.repeats}; {args.new_tokens} new tokens after a "
          f"32-token prompt; commit {commit[:10]})\n",
          "| batch | jitted loop tok/s | Python loop tok/s | jitted / Python | ms/step (jitted) | weights read GB/s |",
          "|---|---|---|---|---|---|"]
    for bsz, r in rows.items():
        md.append(f"| {bsz} | {r['jitted_loop_tokens_per_s']:.1f} | {r['python_loop_tokens_per_s']:.1f} | "
                  f"{r['speedup_jitted_vs_python']:.2f}x | {r['jitted_loop_ms_per_step']:.3f} | "
                  f"{r['weight_read_gb_per_s']:.1f} |")
    md += ["", "| new block T | ms | relative to T=1 |", "|---|---|---|"]
    md += [f"| {t} | {s * 1e3:.2f} | {s / block[1]:.1f}x |" for t, s in block.items()]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
