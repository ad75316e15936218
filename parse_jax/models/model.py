"""`Model`: a config, its params, its tokenizer, and jitted calls into the Flax decoder."""

from __future__ import annotations

import copy
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from parse_jax.errors import ConfigError, InputError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder, causal_metadata


@functools.cache
def decoder_fn(cfg: ModelConfig, attention_impl: str = "xla", return_hidden: bool = False):
    """Jitted `(params, tokens, positions, cache, limit, group) -> (logits, cache, hiddens)`; cache donated."""
    module = Decoder(cfg, attention_impl)

    def run(params, tokens, positions, cache, limit, group):
        return module.apply({"params": params}, tokens, positions, cache, limit, group, return_hidden)

    return jax.jit(run, donate_argnums=(3,))


def init_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """Random params (normal, std 0.02) in the config's dtype: for tests and benchmarks."""
    module = Decoder(cfg)
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = KVCache.init(cfg, 1, 1)
    limit, group = causal_metadata(1, 1)
    init = jax.jit(lambda key: module.init(key, tokens, tokens, cache, limit, group)["params"])
    return init(jax.random.PRNGKey(seed))


class Model:
    """What `pj.load_model` returns: `config`, `params`, `tokenizer`, `logits(ids)`.

    `params` must be the tree `config` implies, names and shapes (dtypes may differ), refused in one line where the
    model is made: a wrong shape is not left to flax's error inside the first program, nor an extra leaf to be
    ignored.

    `eagle3`: the EAGLE-3 head that came with this target (`pj.load_pair` sets the embedded pair's), the default
    head of modes `eagle3` and `parse+eagle3`. `mesh`: None here; a sharded model (`parse_jax.distributed`) has one.
    """

    eagle3: Any = None
    mesh: Any = None

    def __init__(self, config: ModelConfig, params: dict[str, Any], tokenizer: Any = None,
                 attention_impl: str = "xla") -> None:
        if attention_impl not in pallas_kernels.IMPLS:
            raise ConfigError(f"unknown attention_impl {attention_impl!r}; available: "
                              f"{', '.join(pallas_kernels.IMPLS)}")
        problems = param_mismatches(params, config, dtypes=False)  # here, not as flax's error inside a program
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ConfigError(f"params do not fit the config ({config.architecture}, {config.num_layers} layers, "
                              f"hidden {config.hidden_size}): {problems[0]}{more}")
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.attention_impl = attention_impl

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.architecture}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_heads}/{c.num_kv_heads}, vocab={c.vocab_size}, dtype={c.dtype}, "
                f"params={c.num_params / 1e6:.2f}M)")

    def with_params(self, params: dict[str, Any]) -> Model:
        """The same model (config, tokenizer, attention, mesh, attached EAGLE-3 head) with other params of the same
        tree, shapes and dtypes, e.g. fresh from an optimizer. Every jitted program takes the params as an argument,
        so nothing compiles again: each new array is placed like the one it replaces (same sharding, committed),
        since jit compiles anew for arrays placed otherwise (e.g. uncommitted outputs of an uncommitted step)."""
        old, treedef = jax.tree_util.tree_flatten_with_path(self.params)
        new, new_def = jax.tree_util.tree_flatten_with_path(params)
        if new_def != treedef:
            ours, theirs = ({jax.tree_util.keystr(k) for k, _ in t} for t in (old, new))
            diff = sorted(ours - theirs)[:1] or sorted(theirs - ours)[:1] or ["(their nesting)"]
            raise ConfigError(f"with_params: the new params' tree differs from the model's at {diff[0]}")
        placed = []
        for (path, ref), (_, x) in zip(old, new, strict=True):
            if (tuple(np.shape(x)), np.dtype(x.dtype)) != (tuple(np.shape(ref)), np.dtype(ref.dtype)):
                raise ConfigError(f"with_params: {jax.tree_util.keystr(path)} is {x.dtype}{list(np.shape(x))}, "
                                  f"the model's is {ref.dtype}{list(np.shape(ref))}")
            placed.append(jax.device_put(x, ref.sharding) if isinstance(ref, jax.Array) else x)
        model = copy.copy(self)
        model.params = jax.tree.unflatten(treedef, placed)
        model.__dict__.pop("loaded_from", None)  # these params were not read from that checkpoint step
        return model

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return _empty_cache_fn(self.config, batch, max_len)()

    def place_rows(self, x: np.ndarray) -> Any:
        """Per-request host inputs [B, ...] as this model's programs take them: as they are on one device; a sharded
        model puts its rows over the mesh's `data` axis."""
        return x

    def forward(self, tokens, positions, cache: KVCache, limit, group, return_hidden: bool = False):
        """One pass of a new block over `cache` (donated); see `Decoder`."""
        fn = decoder_fn(self.config, self.attention_impl, return_hidden)
        return fn(self.params, tokens, positions, cache, limit, group)

    def logits(self, ids) -> np.ndarray:
        """Plain causal forward from position 0: int [B, T] -> float32 [B, T, V]."""
        try:
            ids = np.asarray(ids)
        except ValueError:  # numpy refuses a ragged list
            raise InputError("logits expects rows of equal length (an int array [B, T]); pad them or call it per "
                             "row") from None
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise InputError(f"logits expects a non-empty int array [B, T], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"logits expects integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise InputError(f"token ids must lie in [0, {self.config.vocab_size}), got range "
                             f"[{ids.min()}, {ids.max()}]")
        b, t = ids.shape
        if t > self.config.max_position_embeddings:
            raise InputError(f"sequence of {t} tokens is longer than max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        limit, group = causal_metadata(b, t)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out, _, _ = self.forward(jnp.asarray(ids, jnp.int32), positions, self.init_cache(b, t), limit, group)
        return np.asarray(out)


@functools.lru_cache(maxsize=64)
def _empty_cache_fn(cfg: ModelConfig, batch: int, max_len: int):
    """One jitted call that builds a zeroed cache: eager `jnp.zeros` per layer costs ~0.2 ms of dispatch each,
    more than a verification pass of the embedded pair."""
    return jax.jit(lambda: KVCache.init(cfg, batch, max_len))


ParamPath = tuple[str, ...]


def expected_params(cfg: ModelConfig) -> dict[ParamPath, jax.ShapeDtypeStruct]:
    """Flattened param tree (path -> shape/dtype) the decoder builds for `cfg`; no memory allocated. Traced once
    per config (an 8B config's trace takes seconds): each call gets its own dict of the same immutable leaves."""
    return dict(_expected_params(cfg))


@functools.lru_cache(maxsize=64)
def _expected_params(cfg: ModelConfig) -> dict[ParamPath, jax.ShapeDtypeStruct]:
    tree = jax.eval_shape(lambda: init_params(cfg))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): leaf for path, leaf in flat}


def param_mismatches(found: Any, cfg: ModelConfig, *, dtypes: bool = True) -> list[str]:
    """Differences between a tree of arrays (or array metadata) and the param tree `cfg` implies: names and shapes,
    and dtypes unless `dtypes=False`."""
    expected = expected_params(cfg)
    try:
        flat = {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(found)[0]}
    except AttributeError:
        return ["params must be a nested dict of arrays"]
    problems = [f"missing {'/'.join(p)}" for p in expected if p not in flat]
    problems += [f"unexpected {'/'.join(p)}" for p in flat if p not in expected]
    for p, leaf in flat.items():
        if p in expected:
            want = expected[p]
            shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", type(leaf).__name__)
            if shape != want.shape or (dtypes and dtype != want.dtype):
                problems.append(f"{'/'.join(p)}: expected {want.dtype}{list(want.shape)}, got {dtype}{list(shape)}")
    return problems


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The nested param tree of `cfg` as `ShapeDtypeStruct`s: a model read as shapes (lowering, memory plans, a
    profile's lookup), nothing allocated or compiled."""
    return unflatten(expected_params(cfg))


def unflatten(flat: dict[ParamPath, Any]) -> dict[str, Any]:
    """A nested param tree from {path tuple: leaf}."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
