"""The Flax decoder shared by Llama-3, Qwen2/2.5 and Qwen3; the config selects each family's details.

Every call is "a new block over a cache": explicit RoPE positions and docs/design.md §2 mask metadata
(`limit`, `group`) make prefill, one-token decode, multi-prefix verification and tree drafts one call.
Parameter names follow HF's module names so that import is a rename and a transpose.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels
from parse_jax.models.cache import KVCache, write_block
from parse_jax.models.config import MASKED_LOGIT, ModelConfig, rope_attention_scaling, rope_inv_freq


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scaling: float = 1.0) -> jax.Array:
    """HF's rotate-half RoPE; x [B, T, H, D], positions [B, T]; `scaling` multiplies cos/sin (yarn's attention
    factor), in float32 before the cast, as transformers does."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _dense(features: int, bias: bool, dtype, name: str) -> nn.Dense:
    init = nn.initializers.normal(0.02)
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=init, name=name)


class Attention(nn.Module):
    cfg: ModelConfig
    attention_impl: str = "xla"

    @nn.compact
    def __call__(self, x, positions, k_cache, v_cache, lengths, limit, group):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        b, t, _ = x.shape
        q = _dense(cfg.num_heads * cfg.head_dim, cfg.qkv_bias, dtype, "q_proj")(x)
        k = _dense(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, dtype, "k_proj")(x)
        v = _dense(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, dtype, "v_proj")(x)
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dtype, name="k_norm")(k)
        inv_freq, scaling = jnp.asarray(rope_inv_freq(cfg)), rope_attention_scaling(cfg)
        q = apply_rope(q, positions, inv_freq, scaling)
        k = apply_rope(k, positions, inv_freq, scaling)
        k_cache = write_block(k_cache, k, lengths)
        v_cache = write_block(v_cache, v, lengths)
        out = pallas_kernels.attention(q, k_cache, v_cache, lengths, limit, group, impl=self.attention_impl)
        out = _dense(cfg.hidden_size, cfg.o_bias, dtype, "o_proj")(out.reshape(b, t, -1))
        return out, k_cache, v_cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        gate = _dense(cfg.intermediate_size, cfg.mlp_bias, dtype, "gate_proj")(x)
        up = _dense(cfg.intermediate_size, cfg.mlp_bias, dtype, "up_proj")(x)
        return _dense(cfg.hidden_size, cfg.mlp_bias, dtype, "down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    attention_impl: str = "xla"

    @nn.compact
    def __call__(self, x, positions, k_cache, v_cache, lengths, limit, group):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        h = RMSNorm(cfg.rms_norm_eps, dtype, name="input_layernorm")(x)
        h, k_cache, v_cache = Attention(cfg, self.attention_impl, name="self_attn")(
            h, positions, k_cache, v_cache, lengths, limit, group)
        x = x + h
        h = RMSNorm(cfg.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        return x + MLP(cfg, name="mlp")(h), k_cache, v_cache


class Decoder(nn.Module):
    """tokens [B, T] + positions + metadata over `cache` -> (logits float32 [B, T, V], cache, hiddens).

    The block's KV is written into the returned cache; `cache.lengths` is left for the caller to commit.
    `hiddens` holds the input of every layer and the final pre-norm state ([layers + 1] arrays) when
    `return_hidden` is set, for feature taps (EAGLE-3); otherwise it is an empty tuple.
    """

    cfg: ModelConfig
    attention_impl: str = "xla"

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache, limit, group, return_hidden: bool = False):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                         embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
        x = embed(tokens)
        ks, vs, hiddens = [], [], []
        for i in range(cfg.num_layers):
            if return_hidden:
                hiddens.append(x)
            x, k_layer, v_layer = DecoderLayer(cfg, self.attention_impl, name=f"layers_{i}")(
                x, positions, cache.k[i], cache.v[i], cache.lengths, limit, group)
            ks.append(k_layer)
            vs.append(v_layer)
        if return_hidden:
            hiddens.append(x)
        x = RMSNorm(cfg.rms_norm_eps, dtype, name="norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = _dense(cfg.vocab_size, False, dtype, "lm_head")(x)
        logits = logits.astype(jnp.float32)
        if cfg.vocab_limit is not None and cfg.vocab_limit < cfg.vocab_size:
            # padded rows (align_vocab) are not tokens: never sampled, never the argmax
            logits = jnp.where(jnp.arange(cfg.vocab_size) < cfg.vocab_limit, logits, MASKED_LOGIT)
        cache = cache.replace(k=tuple(ks), v=tuple(vs))
        return logits, cache, tuple(hiddens)


def causal_metadata(batch: int, t: int) -> tuple[jax.Array, jax.Array]:
    """limit/group of a plain causal block: token i sees block tokens <= i."""
    limit = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32), (batch, t))
    return limit, jnp.zeros((batch, t), jnp.int32)
