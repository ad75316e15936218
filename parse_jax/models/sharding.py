"""Sharding rules beside the params they describe: each param and cache axis has a logical name
(`param_logical_axes`), and `ShardingRules` maps logical axes to mesh axes (docs/design.md §4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parse_jax.errors import ConfigError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import expected_params, unflatten


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None: replicated). Every param and cache axis has a logical name (see
    `param_logical_axes`); `heads`, `kv_heads` and `mlp` must divide by their mesh axis (a clear error
    otherwise); `vocab` falls back to replicated when it does not divide (small vocabularies)."""

    batch: str | None = "data"      # requests: cache rows, verification blocks
    heads: str | None = "model"     # query heads: q_proj out, o_proj in
    kv_heads: str | None = "model"  # key/value heads: k/v_proj out, the cache's head axis
    mlp: str | None = "model"       # MLP hidden: gate/up out, down in
    vocab: str | None = "model"     # embedding rows, lm_head out
    embed: str | None = None        # the residual stream (hidden size)
    head_dim: str | None = None
    sequence: str | None = None     # cache slots

    @classmethod
    def replicated(cls) -> ShardingRules:
        """Every param on every device (a small draft next to a sharded target); requests still split."""
        return cls(heads=None, kv_heads=None, mlp=None, vocab=None)



# Logical axes of each param, keyed by (module, param); the layer prefix `layers_{i}/` is stripped.
_PARAM_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("q_proj", "kernel"): ("embed", "heads"), ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"), ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"), ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", "embed"), ("o_proj", "bias"): ("embed",),
    ("q_norm", "scale"): ("head_dim",), ("k_norm", "scale"): ("head_dim",),
    ("gate_proj", "kernel"): ("embed", "mlp"), ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "kernel"): ("embed", "mlp"), ("up_proj", "bias"): ("mlp",),
    ("down_proj", "kernel"): ("mlp", "embed"), ("down_proj", "bias"): ("embed",),
    ("input_layernorm", "scale"): ("embed",), ("post_attention_layernorm", "scale"): ("embed",),
    ("norm", "scale"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}



CACHE_AXES = ("batch", "kv_heads", "sequence", "head_dim")  # k/v [B, KV, S, D]; lengths [B] is ("batch",)



def param_logical_axes(path: Sequence[str]) -> tuple[str, ...]:
    """Logical axes of the param at `path` (e.g. ("layers_0", "self_attn", "q_proj", "kernel"))."""
    key = tuple(path[-2:])
    if key not in _PARAM_AXES:
        raise ConfigError(f"no sharding rule for param {'/'.join(path)}; add it to distributed._PARAM_AXES")
    return _PARAM_AXES[key]



def check_divisible(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None) -> None:
    """Tensor parallelism splits whole heads and equal MLP slices: refuse a model axis they do not divide."""
    rules = rules or ShardingRules()
    for logical, count, what in (("heads", cfg.num_heads, "attention heads"),
                                 ("kv_heads", cfg.num_kv_heads, "key/value heads"),
                                 ("mlp", cfg.intermediate_size, "MLP hidden units (intermediate_size)")):
        axis = getattr(rules, logical)
        if axis is not None and count % int(mesh.shape[axis]):
            raise ConfigError(f"{count} {what} do not divide over mesh axis {axis!r} of size {mesh.shape[axis]}; "
                              f"choose a {axis} axis size that divides {count}")



def fitting_rules(cfg: ModelConfig, mesh: Mesh, fallback_replicated: bool = False) -> ShardingRules:
    """Tensor-parallel rules when `cfg` divides over the mesh; otherwise replicated params if `fallback_replicated`
    (right for a small draft beside a sharded target), else the divisibility error."""
    try:
        check_divisible(cfg, mesh)
    except ConfigError:
        if not fallback_replicated:
            raise
        return ShardingRules.replicated()
    return ShardingRules()



def _spec(axes: Sequence[str], shape: Sequence[int], mesh: Mesh, rules: ShardingRules) -> P:
    """PartitionSpec of one array; a dimension its mesh axis does not divide (only `vocab` gets here, after
    `check_divisible`) is replicated."""
    out = []
    for logical, dim in zip(axes, shape, strict=True):
        axis = getattr(rules, logical)
        out.append(axis if axis is not None and dim % int(mesh.shape[axis]) == 0 else None)
    return P(*out)



def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None) -> dict[str, Any]:
    """NamedSharding of every param, as a tree shaped like the params."""
    return jax.tree.map(lambda leaf: leaf.sharding, abstract_params(cfg, mesh, rules))



def abstract_params(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None) -> dict[str, Any]:
    """The param tree as `ShapeDtypeStruct`s carrying their NamedShardings: an Orbax restore target, and the
    input of memory accounting. Allocates nothing."""
    rules = rules or ShardingRules()
    check_divisible(cfg, mesh, rules)
    flat = {}
    for path, leaf in expected_params(cfg).items():
        sharding = NamedSharding(mesh, _spec(param_logical_axes(path), leaf.shape, mesh, rules))
        flat[path] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return unflatten(flat)



def cache_shardings(cfg: ModelConfig, mesh: Mesh, batch: int, rules: ShardingRules | None = None) -> KVCache:
    """Shardings of a KV cache of `batch` rows, shaped like `KVCache`: rows on `data` (replicated when `batch`
    does not divide over it), KV heads on `model`."""
    rules = rules or ShardingRules()
    kv = NamedSharding(mesh, _spec(CACHE_AXES, (batch, cfg.num_kv_heads, 1, cfg.head_dim), mesh, rules))
    lengths = NamedSharding(mesh, _spec(("batch",), (batch,), mesh, rules))
    layers = range(cfg.num_layers)
    return KVCache(k=tuple(kv for _ in layers), v=tuple(kv for _ in layers), lengths=lengths)
