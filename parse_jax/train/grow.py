"""Function-preserving widening of a trained decoder (Net2Net-style, with zero-initialised outputs).

Training a weight-bound target (10M+ parameters) from scratch costs ~3 s per AdamW step on the 2-core CPU; the
recipe instead trains a narrow target, widens it here without changing its logits, then trains at full width.

How a wider tree computes the same function:
- the residual stream gets new dimensions that stay exactly zero: the embedding's new columns and the new output
  columns of every kernel that writes into the residual (`o_proj`, `down_proj`) are zero;
- RMSNorm now averages over more dimensions, of which only the old ones are non-zero (the normalised values grow by
  sqrt(new_hidden / old_hidden)), so each old scale is divided by that factor and `rms_norm_eps` is multiplied by
  old_hidden / new_hidden (`grown_config`): then the wide norm equals the narrow one exactly;
- new attention heads and FFN units read the (normalised) old dimensions through random weights, but their
  outputs enter the residual through zero `o_proj` / `down_proj` rows (kernels are [in, out]); the rows of every
  reading kernel that belong to the new (zero) residual dimensions are random too, so they start learning at once.
Models with q/k RMSNorm (Qwen3) are refused: those norms share `rms_norm_eps`, which the rescaling changes.
The zeros are not a fixed point: gradients reach them through the random weights, as with zero-initialised
residual branches. Head dimension, depth, vocabulary and RoPE stay the same.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.models.config import ModelConfig

INIT_STD = 0.02


def grown_config(src: ModelConfig, dst: ModelConfig) -> ModelConfig:
    """`dst` with the RMSNorm epsilon that keeps the widened norms equal to `src`'s."""
    return dst.replace(rms_norm_eps=src.rms_norm_eps * src.hidden_size / dst.hidden_size)


def check_growable(src: ModelConfig, dst: ModelConfig) -> None:
    """Widening keeps depth, head_dim, vocabulary, heads' grouping; widths may only grow."""
    if not np.isclose(dst.rms_norm_eps, src.rms_norm_eps * src.hidden_size / dst.hidden_size, rtol=1e-9, atol=0):
        raise ConfigError(f"cannot widen: rms_norm_eps must be {src.rms_norm_eps} * {src.hidden_size} / "
                          f"{dst.hidden_size} (use grow.grown_config), got {dst.rms_norm_eps}")
    if src.qk_norm:
        raise ConfigError("cannot widen a model with q/k RMSNorm (Qwen3): those norms share rms_norm_eps with the "
                          "residual norms, and the rescaled eps that keeps the residual norms exact would change them")
    same = ("architecture", "vocab_size", "num_layers", "head_dim", "rope_theta", "rope_type",
            "rope_scaling", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_word_embeddings", "dtype")
    for name in same:
        if getattr(src, name) != getattr(dst, name):
            raise ConfigError(f"cannot widen: {name} differs ({getattr(src, name)!r} -> {getattr(dst, name)!r}); "
                              "widening changes hidden_size, intermediate_size and head counts only")
    for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads"):
        if getattr(dst, name) < getattr(src, name):
            raise ConfigError(f"cannot widen: {name} would shrink ({getattr(src, name)} -> {getattr(dst, name)})")
    if dst.num_heads // dst.num_kv_heads != src.num_heads // src.num_kv_heads:
        raise ConfigError("cannot widen: num_heads / num_kv_heads must stay the same "
                          f"({src.num_heads}/{src.num_kv_heads} -> {dst.num_heads}/{dst.num_kv_heads})")


def _embed(old: np.ndarray, shape: tuple[int, ...], rng: np.random.Generator, fill: str) -> np.ndarray:
    """`old` in the leading corner of a new array of `shape`; the rest random (`fill="random"`) or zero."""
    new = (rng.normal(0.0, INIT_STD, shape) if fill == "random" else np.zeros(shape)).astype(old.dtype)
    new[tuple(slice(0, n) for n in old.shape)] = old
    return new


def widen_params(params: dict[str, Any], src: ModelConfig, dst: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """`params` of `src` as a tree of the wider `dst` that computes the same logits (see module docstring)."""
    check_growable(src, dst)
    rng = np.random.default_rng(seed)
    p = jax.tree.map(np.asarray, params)
    h0, h1 = src.hidden_size, dst.hidden_size
    norm_gain = np.sqrt(h0 / h1)

    def norm(scale: np.ndarray) -> np.ndarray:
        # new dimensions are zero at first, so their scale is free: the old scales' mean, as a neutral start
        scaled = scale * norm_gain
        out = np.full((h1,), scaled.mean(), scale.dtype)
        out[:h0] = scaled
        return out

    def bias(b: np.ndarray, n: int) -> np.ndarray:
        return _embed(b, (n,), rng, "zero")

    out: dict[str, Any] = {}
    emb = p["embed_tokens"]["embedding"]
    out["embed_tokens"] = {"embedding": _embed(emb, (emb.shape[0], h1), rng, "zero")}
    d = dst.head_dim
    for i in range(src.num_layers):
        lp = p[f"layers_{i}"]
        a, m = lp["self_attn"], lp["mlp"]
        attn: dict[str, Any] = {}
        # q/k/v [hidden, heads * head_dim]: heads are contiguous column groups, new heads appended (random); with
        # the q/kv ratio kept, old query heads still read old KV heads.
        for name, heads1 in (("q_proj", dst.num_heads), ("k_proj", dst.num_kv_heads), ("v_proj", dst.num_kv_heads)):
            attn[name] = {"kernel": _embed(a[name]["kernel"], (h1, heads1 * d), rng, "random")}
            if "bias" in a[name]:
                attn[name]["bias"] = bias(a[name]["bias"], heads1 * d)
        # o_proj [heads * head_dim, hidden]: new heads' rows and new residual columns zero.
        o = np.zeros((dst.num_heads * d, h1), a["o_proj"]["kernel"].dtype)
        o[: src.num_heads * d, :h0] = a["o_proj"]["kernel"]
        attn["o_proj"] = {"kernel": o}
        if "bias" in a["o_proj"]:
            attn["o_proj"]["bias"] = bias(a["o_proj"]["bias"], h1)
        mlp: dict[str, Any] = {}
        for name in ("gate_proj", "up_proj"):
            mlp[name] = {"kernel": _embed(m[name]["kernel"], (h1, dst.intermediate_size), rng, "random")}
            if "bias" in m[name]:
                mlp[name]["bias"] = bias(m[name]["bias"], dst.intermediate_size)
        down = np.zeros((dst.intermediate_size, h1), m["down_proj"]["kernel"].dtype)
        down[: src.intermediate_size, :h0] = m["down_proj"]["kernel"]
        mlp["down_proj"] = {"kernel": down}
        if "bias" in m["down_proj"]:
            mlp["down_proj"]["bias"] = bias(m["down_proj"]["bias"], h1)
        out[f"layers_{i}"] = {
            "input_layernorm": {"scale": norm(lp["input_layernorm"]["scale"])},
            "post_attention_layernorm": {"scale": norm(lp["post_attention_layernorm"]["scale"])},
            "self_attn": attn, "mlp": mlp}
    out["norm"] = {"scale": norm(p["norm"]["scale"])}
    if "lm_head" in p:  # new rows read the new (zero) dimensions of the final norm: random, like every reader
        out["lm_head"] = {"kernel": _embed(p["lm_head"]["kernel"], (h1, emb.shape[0]), rng, "random")}
    return out
