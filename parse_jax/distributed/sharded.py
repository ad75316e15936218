"""Sharded models and caches: `shard_model(model, mesh)` places every param by `ShardingRules` and returns a
`ShardedModel`, whose caches are born sharded, so the engine's jitted programs run partitioned by GSPMD unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels
from parse_jax.distributed.mesh import check_mesh, mesh_shape, on_mesh
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model
from parse_jax.models.sharding import ShardingRules, cache_shardings, fitting_rules, param_shardings


class ShardedModel(Model):
    """A `Model` whose params live sharded on `mesh`; its caches are born sharded, so every jitted program of the
    engine (which takes params and cache as arguments) runs partitioned by GSPMD with no change to it."""

    def __init__(self, config: ModelConfig, params: dict[str, Any], tokenizer: Any, attention_impl: str,
                 mesh: Mesh, rules: ShardingRules) -> None:
        super().__init__(config, params, tokenizer, attention_impl)
        self.mesh, self.rules = mesh, rules

    def __repr__(self) -> str:
        d, m = mesh_shape(self.mesh)
        return f"{super().__repr__()[:-1]}, mesh=data {d} x model {m})"

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return _sharded_cache_fn(self.config, batch, max_len, self.mesh, self.rules)()

    def place_rows(self, x: np.ndarray) -> jax.Array:
        return shard_rows(x, self.mesh)



@functools.lru_cache(maxsize=64)
def _sharded_cache_fn(cfg: ModelConfig, batch: int, max_len: int, mesh: Mesh, rules: ShardingRules):
    return jax.jit(lambda: KVCache.init(cfg, batch, max_len), out_shardings=cache_shardings(cfg, mesh, batch, rules))



def replicate(tree: Any, mesh: Mesh) -> Any:
    """Every array of `tree` whole on every device of `mesh` (small params used beside sharded ones)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))



def shard_model(model: Model, mesh: Mesh, rules: ShardingRules | None = None,
                fallback_replicated: bool = False) -> ShardedModel:
    """The same model with its params placed by `rules` (default: tensor parallel, see `fitting_rules`) on `mesh`.
    An EAGLE-3 head attached to the model (`model.eagle3`, as `pj.load_pair` attaches it) comes along, replicated."""
    check_mesh(mesh, needed_by="shard_model")
    rules = rules or fitting_rules(model.config, mesh, fallback_replicated)
    shardings = param_shardings(model.config, mesh, rules)
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), model.params, shardings)
    sharded = ShardedModel(model.config, params, model.tokenizer, model.attention_impl, mesh, rules)
    head = model.eagle3
    if head is not None:
        sharded.eagle3 = dataclasses.replace(head, params=replicate(head.params, mesh))
    return sharded



def shard_cache(cache: KVCache, cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None) -> KVCache:
    """An existing cache moved to its sharded layout."""
    return jax.device_put(cache, cache_shardings(cfg, mesh, cache.batch, rules))



def global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array placed by `sharding`; each process reads only the slices its devices hold, so this also
    builds the global input on a multi-host mesh (every process passes the same host array)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])



def shard_rows(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array of per-request rows [B, ...] placed with its rows on `data` (replicated when B does not divide
    over it): jitted programs fed such inputs keep each data shard's requests on its own devices."""
    x = np.asarray(x)
    axis = "data" if x.shape[0] % int(mesh.shape["data"]) == 0 else None
    return global_array(x, NamedSharding(mesh, P(axis)))



def pad_cache(cache: KVCache, batch: int) -> KVCache:
    """`cache` with empty rows (length 0) appended up to `batch` rows."""
    extra = batch - cache.batch
    if extra <= 0:
        return cache
    grow = lambda x: jnp.concatenate([x, jnp.zeros((extra, *x.shape[1:]), x.dtype)])  # noqa: E731
    return KVCache(k=tuple(map(grow, cache.k)), v=tuple(map(grow, cache.v)), lengths=grow(cache.lengths))



def kernel_context(model: Model):
    """What a run of `model` (and the models beside it on its mesh) traces under: `jax.set_mesh(model.mesh)` when it
    is sharded and attends with a Pallas kernel, so that the kernel sees the mesh and runs under `shard_map`, one
    kernel per device's shard (XLA cannot partition a Mosaic or Triton call; interpreted kernels take the same
    path). Otherwise nothing changes: arrays made under a mesh carry it in jax 0.10 (a cached PRNG key made there
    is refused under another mesh), so dense attention, which GSPMD partitions, stays off it."""
    mesh = getattr(model, "mesh", None)
    if mesh is None or pallas_kernels.resolve(model.attention_impl, jax.default_backend())[0] == "xla":
        return contextlib.nullcontext()
    return on_mesh(mesh)
