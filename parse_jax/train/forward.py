"""A training-only forward over the `Decoder`'s param tree: plain causal attention from position 0, no KV cache.

The `Decoder` serves every inference shape through a cache and mask metadata; for training that generality
costs (scatter into the cache, dense visibility from metadata, and their gradients): this plain forward is about
twice as fast on the CPU. It reads the same params, so a trained tree loads into `Model` unchanged, and a test
checks its logits equal `Model.logits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import visibility
from parse_jax.models.config import ModelConfig, rope_attention_scaling, rope_inv_freq
from parse_jax.models.decoder import apply_rope
from parse_jax.models.functional import linear, rms_norm


def train_logits(params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None,
                 limit: jax.Array | None = None, group: jax.Array | None = None) -> jax.Array:
    """int [B, T] -> float32 logits [B, T, V] (float32 models). Without metadata: causal, positions 0..T-1; with
    `positions`, `limit` and `group` [B, T]: the multi-prefix mask of docs/design.md §2 over the row alone (no
    cache)."""
    return train_forward(params, cfg, tokens, positions, limit, group)[0]


def train_forward(params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None,
                  limit: jax.Array | None = None, group: jax.Array | None = None
                  ) -> tuple[jax.Array, list[jax.Array]]:
    """`train_logits` and the hidden states the `Decoder` returns with `return_hidden` (each layer's input, then
    the final pre-norm state): the EAGLE-3 head's features."""
    b, t = tokens.shape
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    emb = params["embed_tokens"]["embedding"]
    x = emb[tokens]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inv_freq, scaling = jnp.asarray(rope_inv_freq(cfg)), rope_attention_scaling(cfg)  # as the Decoder applies it
    if limit is None:
        mask = jnp.tril(jnp.ones((t, t), bool))
    else:
        mask = visibility(jnp.zeros((b,), jnp.int32), limit, group, t)[:, None]
    hiddens = []
    for i in range(cfg.num_layers):
        hiddens.append(x)
        lp = params[f"layers_{i}"]
        a = lp["self_attn"]
        y = rms_norm(x, lp["input_layernorm"]["scale"], cfg.rms_norm_eps)
        q = linear(a["q_proj"], y).reshape(b, t, h, d)
        k = linear(a["k_proj"], y).reshape(b, t, kvh, d)
        v = linear(a["v_proj"], y).reshape(b, t, kvh, d)
        if cfg.qk_norm:
            q = rms_norm(q, a["q_norm"]["scale"], cfg.rms_norm_eps)
            k = rms_norm(k, a["k_norm"]["scale"], cfg.rms_norm_eps)
        q, k = apply_rope(q, positions, inv_freq, scaling), apply_rope(k, positions, inv_freq, scaling)
        if kvh != h:
            k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k) * d ** -0.5
        s = jnp.where(mask, s, -1e30)
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, h * d)
        x = x + linear(a["o_proj"], o)
        m = lp["mlp"]
        y = rms_norm(x, lp["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
        x = x + linear(m["down_proj"], jax.nn.silu(linear(m["gate_proj"], y)) * linear(m["up_proj"], y))
    hiddens.append(x)
    x = rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps)
    logits = x @ emb.T if cfg.tie_word_embeddings else linear(params["lm_head"], x)
    return logits.astype(jnp.float32), hiddens
