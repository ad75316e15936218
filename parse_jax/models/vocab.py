"""Pairs whose tokenizers are identical but whose embeddings are padded to different row counts (Qwen2.5-7B has
152064 rows, Qwen2.5-0.5B 151936, one tokenizer of 151665 ids): pad the smaller model up to the larger one and mask
every padding row, so target and draft share one vocabulary axis and no padding row is ever sampled.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.models.model import Model


def align_vocab(target: Model, draft: Model) -> tuple[Model, Model]:
    """(target, draft) with equal `config.vocab_size`: the model with fewer rows gets zero rows appended to its
    embedding (and lm_head), and both mask logits of rows >= the smaller row count (`ModelConfig.vocab_limit`),
    so the real rows' logits are unchanged and padding rows are never sampled nor the argmax.

    Equal row counts are returned as they are. Different row counts need both tokenizers, identical (same
    id -> token map, merges, pre-tokenizer, normalizer, decoder); anything else is a ConfigError naming both
    sizes."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv == dv:
        if target.tokenizer is not None and draft.tokenizer is not None:
            _check_same_tokenizer(target, draft)
        return target, draft
    if target.tokenizer is None or draft.tokenizer is None:
        raise ConfigError(f"target and draft have different vocabulary sizes (target {tv} rows, draft {dv} rows) "
                          f"and {'the target' if target.tokenizer is None else 'the draft'} has no tokenizer to "
                          "show that they share one; padding is only safe for identical tokenizers")
    _check_same_tokenizer(target, draft)
    limit = min(tv, dv, target.config.real_vocab_size, draft.config.real_vocab_size)
    size = max(tv, dv)
    return pad_vocab(target, size, limit), pad_vocab(draft, size, limit)


def _check_same_tokenizer(target: Model, draft: Model) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if not target.tokenizer.same_vocabulary(draft.tokenizer):
        raise ConfigError(
            f"target and draft tokenizers differ (target: {target.tokenizer.vocab_size} tokens, {tv} embedding rows, "
            f"{target.tokenizer.source}; draft: {draft.tokenizer.vocab_size} tokens, {dv} embedding rows, "
            f"{draft.tokenizer.source}): speculative decoding needs one tokenizer for both models")


def pad_vocab(model: Model, size: int, limit: int) -> Model:
    """`model` with `size` embedding / lm_head rows (zeros appended) and logits of rows >= `limit` masked. The
    copy keeps the tokenizer, attention, mesh and any attached head; params keep their sharding kind."""
    cfg = model.config
    if size < cfg.vocab_size:
        raise ConfigError(f"cannot pad a vocabulary of {cfg.vocab_size} rows down to {size}")
    new_cfg = cfg.replace(vocab_size=size, vocab_limit=min(limit, cfg.real_vocab_size))
    if new_cfg == cfg:
        return model
    extra = size - cfg.vocab_size
    params = jax.tree.map(lambda x: x, model.params)  # a new tree; leaves shared until replaced
    if extra:
        embed = params["embed_tokens"]["embedding"]
        params["embed_tokens"] = {**params["embed_tokens"], "embedding": _pad(embed, ((0, extra), (0, 0)))}
        if "lm_head" in params:
            kernel = params["lm_head"]["kernel"]
            params["lm_head"] = {**params["lm_head"], "kernel": _pad(kernel, ((0, 0), (0, extra)))}
    mesh = getattr(model, "mesh", None)
    if mesh is not None and extra:
        from parse_jax.models.sharding import param_shardings

        params = jax.tree.map(jax.device_put, params, param_shardings(new_cfg, mesh, model.rules))
    out = copy.copy(model)
    out.config, out.params = new_cfg, params
    out.__dict__.pop("loaded_from", None)  # no longer the params of that checkpoint
    return out


def _pad(x: Any, widths: tuple[tuple[int, int], ...]) -> Any:
    """`x` with zero rows / columns appended; shape-only params (`jax.ShapeDtypeStruct`: a model `parse-jax lower`
    plans from its config alone) get the padded shape."""
    if isinstance(x, jax.ShapeDtypeStruct):
        shape = tuple(n + lo + hi for n, (lo, hi) in zip(x.shape, widths, strict=True))
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)
    return jnp.pad(jnp.asarray(x), widths) if isinstance(x, jax.Array) else jnp.asarray(np.pad(x, widths))
