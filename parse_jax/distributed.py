"""Scale-out: a (data, model) device mesh, sharding rules for params and KV cache, verification batches under
`shard_map`, Orbax restore straight into a sharded layout, and the multi-host entry.

How the pieces fit:
- `make_mesh({"data": 2, "model": 4})`: requests are split over `data`, tensors (attention heads, MLP hidden,
  vocab) over `model`. `model` is the mesh's inner axis, so it maps to the closest devices (one host, ICI).
- `shard_model(model, mesh)` places every param with a `NamedSharding` from `ShardingRules` and returns a
  `ShardedModel`: a `Model` whose `init_cache` builds a sharded cache. The engine's existing jitted programs
  (prefill, decode loop, verification, continuation) then run partitioned by GSPMD, unchanged.
- `sharded_verify_pass` has `verify.verify_pass`'s signature and result: `shard_map` over `data` runs the
  verification program on each data shard's rows (its requests' packed blocks); inside, `model` stays an
  automatic axis, so the same pass is tensor parallel over the target's sharded weights. Scores are gathered.
- `load_sharded(path, mesh)` restores an Orbax checkpoint into an abstract tree of `ShapeDtypeStruct`s that
  carry the target shardings: each device reads only its shards, and the saving device count does not matter.
- `add_distributed_args` / `initialize_from_args` / `process_slice` / `gather_token_lists` / `is_writer`:
  the multi-host entry for a CLI (`jax.distributed.initialize`, explicit flags or the cluster's environment).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parse_jax.distributed_args import add_distributed_args  # noqa: F401  (re-exported: the CLI flags)
from parse_jax.errors import CheckpointError, ConfigError, InputError
from parse_jax.layout import PackedBlock, check_boundaries, pack
from parse_jax.models import checkpoint_manager
from parse_jax.models.cache import KVCache
from parse_jax.models.checkpoint import CONFIG_FILE, load_model, restore_params
from parse_jax.models.config import ModelConfig
from parse_jax.models.hf_import import check_vocab, expected_params, unflatten
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.programs import bucket, register_program, to_host
from parse_jax.verify import VerifyOutput, check_blocks, verify_arrays, verify_program

AXES = ("data", "model")
T = TypeVar("T")

# ------------------------------------------------------------------------------------------------ the mesh


def parse_mesh_spec(spec: str | Mapping[str, int] | Path | None) -> dict[str, int]:
    """`{"data": 2, "model": 4}`, `"data=2,model=4"`, or a YAML file holding such a mapping (top level or under
    `mesh:`) -> axis sizes. A missing axis is 1; one axis may be -1 (all remaining devices)."""
    from parse_jax.validation import check_int

    if spec is None:
        return {"data": -1, "model": 1}
    where = "mesh spec"
    if isinstance(spec, Path) or (isinstance(spec, str) and spec.endswith((".yaml", ".yml"))):
        import yaml

        path = Path(spec)
        where = f"mesh config file {path}"
        if not path.is_file():
            raise ConfigError(f"mesh config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"{path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read mesh config file {path}: {e}") from None
        spec = loaded.get("mesh", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{path} must hold a mapping like `mesh: {{data: 2, model: 4}}`")
    if isinstance(spec, str):
        pairs: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"mesh spec {spec!r}: expected `axis=size` pairs like data=2,model=4")
            if name.strip() in pairs:
                raise ConfigError(f"mesh spec {spec!r}: axis {name.strip()!r} given twice")
            pairs[name.strip()] = value.strip()
        spec = pairs
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a mesh is a mapping of axis sizes like {{'data': 2, 'model': 4}}, got {spec!r}")
    unknown = sorted(str(k) for k in set(spec) - set(AXES))
    if unknown:
        raise ConfigError(f"{where}: unknown mesh axes {unknown}; the mesh axes are {list(AXES)}")
    sizes = {}
    for name in AXES:
        value = spec.get(name, 1)
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"{where}: mesh axis {name} must be an integer, got {value!r}") from None
        size = check_int(f"{where}: mesh axis {name}", value)
        if size == 0 or size < -1:
            raise ConfigError(f"{where}: mesh axis {name} must be >= 1 (or -1: all remaining devices), got {size}")
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError("at most one mesh axis may be -1")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | Path | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: every device of every process). Its size must equal
    the device count: a mesh that leaves devices idle, or needs more than exist, is a configuration error."""
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if -1 in sizes.values():
        fixed = int(np.prod([s for s in sizes.values() if s != -1]))
        if n % fixed:
            raise ConfigError(f"mesh {sizes}: {n} devices are not a multiple of the fixed axes' product {fixed}")
        sizes = {k: (n // fixed if v == -1 else v) for k, v in sizes.items()}
    total = sizes["data"] * sizes["model"]
    if total != n:
        raise ConfigError(f"mesh data={sizes['data']} x model={sizes['model']} = {total} devices, but {n} "
                          f"device(s) are available ({devices[0].platform}); the mesh must use every device "
                          "exactly once")
    auto = (jax.sharding.AxisType.Auto,) * 2  # GSPMD propagation: the engine's programs need no annotations
    return jax.make_mesh((sizes["data"], sizes["model"]), AXES, axis_types=auto, devices=devices)


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    return int(mesh.shape["data"]), int(mesh.shape["model"])


# ------------------------------------------------------------------------------------------------ sharding rules


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


# ------------------------------------------------------------------------------------------------ verification


def _global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array placed by `sharding`; each process reads only the slices its devices hold, so this also
    builds the global input on a multi-host mesh (every process passes the same host array)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_rows(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array of per-request rows [B, ...] placed with its rows on `data` (replicated when B does not divide
    over it): jitted programs fed such inputs keep each data shard's requests on its own devices."""
    x = np.asarray(x)
    axis = "data" if x.shape[0] % int(mesh.shape["data"]) == 0 else None
    return _global_array(x, NamedSharding(mesh, P(axis)))


def pad_cache(cache: KVCache, batch: int) -> KVCache:
    """`cache` with empty rows (length 0) appended up to `batch` rows."""
    extra = batch - cache.batch
    if extra <= 0:
        return cache
    grow = lambda x: jnp.concatenate([x, jnp.zeros((extra, *x.shape[1:]), x.dtype)])  # noqa: E731
    return KVCache(k=tuple(map(grow, cache.k)), v=tuple(map(grow, cache.v)), lengths=grow(cache.lengths))


@functools.cache
def _sharded_verify_program(cfg: ModelConfig, attention_impl: str, mesh: Mesh, taps: tuple[int, ...]):
    """`verify.py`'s verification program under `shard_map` over `data`: each data shard runs it on its own
    rows. Only `data` is manual; `model` stays automatic, so inside each shard the pass is tensor parallel over
    the params' `model` sharding (GSPMD), in the same program."""
    program = verify_program(cfg, attention_impl, taps)
    rows = P("data")
    fn = jax.shard_map(program, mesh=mesh, axis_names=frozenset({"data"}),
                       in_specs=(P(), rows, rows, rows, rows, rows, rows, rows, P(), P()),
                       out_specs=(rows, rows, rows, rows if taps else None))
    return register_program(jax.jit(fn, donate_argnums=(1,)))


def sharded_verify_pass(model: Model, cache: KVCache, blocks: Sequence[PackedBlock], yes_id: int, no_id: int,
                        length: int | None = None, num_prefixes: int | None = None,
                        before_index: Sequence[int] | None = None, taps: Sequence[int] = (),
                        mesh: Mesh | None = None) -> VerifyOutput:
    """`verify.verify_pass` with the batch of packed blocks spread over the mesh's `data` axis by `shard_map`.

    Same arguments and result. `mesh` defaults to the model's (a `ShardedModel`). A batch that does not divide
    over `data` is padded with empty rows (a one-token block over an empty cache row) and the result unpadded.
    """
    mesh = mesh or model.mesh
    if mesh is None:
        raise ConfigError("sharded_verify_pass needs a mesh: pass mesh=... or a model from shard_model")
    n = len(blocks)
    length, k_max = check_blocks(cache, blocks, length, num_prefixes)
    data = mesh_shape(mesh)[0]
    padded = -(-n // data) * data
    blocks = list(blocks) + [pack(0, [0], [1], [0])] * (padded - n)  # 2 tokens: fits any block length
    arrays = verify_arrays(blocks, length, k_max, before_index)
    rows = NamedSharding(mesh, P("data"))
    inputs = [_global_array(arrays[name], rows) for name in
              ("tokens", "positions", "limit", "group", "score_index", "boundary_index")]
    rules = (model.rules if isinstance(model, ShardedModel)
             else fitting_rules(model.config, mesh, fallback_replicated=True))
    cache = jax.device_put(pad_cache(cache, padded), cache_shardings(model.config, mesh, padded, rules))
    taps = tuple(int(t) for t in taps)
    program = _sharded_verify_program(model.config, model.attention_impl, mesh, taps)
    scores, boundary_logits, cache, features = program(model.params, cache, *inputs, np.int32(yes_id),
                                                       np.int32(no_id))
    scores = np.where(arrays["valid"], to_host(scores), np.nan)[:n]
    if padded != n:
        boundary_logits, cache, features = jax.tree.map(lambda x: x[:n], (boundary_logits, cache, features))
    return VerifyOutput(scores=scores, boundary_logits=boundary_logits, cache=cache,
                        tokens=arrays["tokens"][:n] if taps else None, features=features)


def sharded_prefix_scores(engine: Any, contexts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]],
                          boundaries: Sequence[Sequence[int]], mesh: Mesh | None = None) -> list[np.ndarray]:
    """`engine.prefix_scores` for a batch of requests in ONE pass, the requests spread over `data`: request i's
    scores equal `engine.prefix_scores(contexts[i], drafts[i], boundaries[i])`. `engine.target` must be sharded
    (`shard_model`) or `mesh` given (the target is then sharded here)."""
    if not (len(contexts) == len(drafts) == len(boundaries)) or not contexts:
        raise InputError("contexts, drafts and boundaries must be non-empty lists of the same length")
    target = engine.target
    mesh = mesh or target.mesh
    if mesh is None:
        raise ConfigError("sharded_prefix_scores needs a mesh: pass mesh=... or shard the engine's target")
    if target.mesh is not mesh:
        target = shard_model(target, mesh)
    blocks, counts = [], []
    for ctx, draft, bounds in zip(contexts, drafts, boundaries, strict=True):
        ctx, draft = engine._ids("context_ids", ctx), engine._ids("draft_ids", draft)
        bounds = check_boundaries(bounds, len(draft))
        engine.check_block_positions(len(ctx), len(draft))
        blocks.append(pack(0, ctx + draft, [len(ctx) + b for b in bounds], engine.suffix_ids))
        counts.append(len(bounds))
    length = bucket(max(b.length for b in blocks))
    cache = target.init_cache(len(blocks), length)
    out = sharded_verify_pass(target, cache, blocks, engine.yes_id, engine.no_id, length, bucket(max(counts), 1),
                              mesh=mesh)
    return [out.scores[i, :k].astype(np.float64) for i, k in enumerate(counts)]


# ------------------------------------------------------------------------------------------------ sharded loading


def restore_sharded_params(folder: str | Path, cfg: ModelConfig, mesh: Mesh,
                           rules: ShardingRules | None = None) -> dict[str, Any]:
    """Orbax restore of a parse-jax checkpoint's params straight into their sharded layout: the target is an
    abstract tree of `ShapeDtypeStruct`s with NamedShardings, so each device reads only its own slices, whatever
    device count or layout wrote the checkpoint."""
    return restore_params(Path(folder), cfg, abstract_params(cfg, mesh, rules))


def load_sharded(path: str | Path, mesh: Mesh, rules: ShardingRules | None = None, dtype: str | None = None,
                 check_finite: bool = True, attention_impl: str = "xla",
                 fallback_replicated: bool = False, step: int | None = None, params_path: str | None = None,
                 config_from: Any = None) -> ShardedModel:
    """`pj.load_model` onto a mesh. A parse-jax (Orbax) checkpoint, or a step of an Orbax CheckpointManager folder
    (`step`, `params_path`, `config_from`: see `checkpoint_manager.load_run`), is restored shard by shard, never
    whole on one device; so is a Hugging Face folder (each device reads its slices of the safetensors files,
    `hf_import.load_hf_sharded`). `rules` default: `fitting_rules(config, mesh, fallback_replicated)`."""
    path = Path(path).absolute()
    if checkpoint_manager.locate(path, step) is not None:
        return checkpoint_manager.load_run(path, step, params_path, config_from, mesh=mesh, rules=rules,
                                           fallback_replicated=fallback_replicated, dtype=dtype,
                                           check_finite=check_finite, attention_impl=attention_impl)
    if not (path / CONFIG_FILE).is_file() and (path / "config.json").is_file():
        from parse_jax.models.hf_import import load_hf_sharded

        return load_hf_sharded(path, mesh, rules, dtype=dtype, check_finite=check_finite,
                               attention_impl=attention_impl, fallback_replicated=fallback_replicated)
    if not (path / CONFIG_FILE).is_file():
        model = load_model(path, dtype=dtype, check_finite=check_finite, attention_impl=attention_impl)
        return shard_model(model, mesh, rules, fallback_replicated)
    try:
        d = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path / CONFIG_FILE} is not valid JSON: {e}") from None
    cfg = ModelConfig.from_dict(d)
    rules = rules or fitting_rules(cfg, mesh, fallback_replicated)
    params = restore_sharded_params(path, cfg, mesh, rules)
    if check_finite:
        bad = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
               if not bool(jnp.isfinite(x).all())]
        if bad:
            raise CheckpointError(f"checkpoint {path} has non-finite values (inf/nan) in: {', '.join(bad)}")
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)  # elementwise: keeps each sharding
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(path)
        check_vocab(tokenizer, cfg)
    return ShardedModel(cfg, params, tokenizer, attention_impl, mesh, rules)


# ------------------------------------------------------------------------------------------------ multi-host

# Set by a launcher (SLURM, Open MPI, a TPU pod) when several processes form one job.
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def wants_auto_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for multi-process JAX with no explicit flags: PARSE_JAX_DISTRIBUTED=1, or a
    launcher that started more than one task (SLURM_NTASKS, OMPI_COMM_WORLD_SIZE), or a multi-host TPU slice
    (TPU_WORKER_HOSTNAMES lists more than one worker)."""
    env = os.environ if env is None else env
    if env.get("PARSE_JAX_DISTRIBUTED", "") not in ("", "0"):
        return True
    if any(env.get(k, "1").isdigit() and int(env.get(k, "1")) > 1 for k in _CLUSTER_ENV):
        return True
    return len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


def initialize_from_args(args: argparse.Namespace) -> Mesh | None:
    """Start multi-host JAX if asked (flags, or the cluster's environment), then build the mesh of `--mesh` over
    every process's devices (one program spans them all), or with `--per-host` over this process's own devices.
    Call before anything touches a device."""
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ConfigError("--coordinator, --num-processes and --process-id go together")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(f"--process-id {args.process_id} must lie in [0, {args.num_processes})")
        if not jax.distributed.is_initialized():
            jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id)
    elif (getattr(args, "distributed", False) or wants_auto_distributed()) and not jax.distributed.is_initialized():
        jax.distributed.initialize()
    if not args.mesh:
        return None
    return make_mesh(args.mesh, jax.local_devices() if getattr(args, "per_host", False) else None)


def is_writer() -> bool:
    """Only process 0 writes results, logs and checkpoints' metadata: the others would write the same."""
    return jax.process_index() == 0


def process_bounds(n: int, process_index: int | None = None, process_count: int | None = None) -> tuple[int, int]:
    """[start, end) of this process's contiguous share of `n` items (the first `n % count` get one more)."""
    i = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    per, extra = divmod(n, count)
    start = i * per + min(i, extra)
    return start, start + per + (i < extra)


def process_slice(items: Sequence[T], process_index: int | None = None,
                  process_count: int | None = None) -> list[T]:
    """Per-host input feeding: this process's contiguous share of the requests."""
    start, end = process_bounds(len(items), process_index, process_count)
    return list(items[start:end])


def gather_token_lists(local: Sequence[Sequence[int]], total: int) -> list[list[int]]:
    """Every process's `process_slice` results, in request order, on every process (so the writer can write
    them all). `total` is the number of requests before slicing. One process: `local` itself."""
    if jax.process_count() == 1:
        return [list(t) for t in local]
    from jax.experimental import multihost_utils

    per = -(-total // jax.process_count())
    width = int(multihost_utils.process_allgather(np.int32(max([len(t) for t in local], default=0))).max())
    buf = np.full((per, max(width, 1)), -1, np.int32)
    lens = np.full((per,), -1, np.int32)  # -1: no request in this row
    for i, t in enumerate(local):
        buf[i, : len(t)] = t
        lens[i] = len(t)
    all_bufs = np.asarray(multihost_utils.process_allgather(buf))
    all_lens = np.asarray(multihost_utils.process_allgather(lens))
    return [all_bufs[p, i, : all_lens[p, i]].tolist()
            for p in range(all_bufs.shape[0]) for i in range(per) if all_lens[p, i] >= 0]
