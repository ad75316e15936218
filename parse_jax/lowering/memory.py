"""A run's device memory, estimated before anything is allocated: weights, KV caches, the largest pass's
activations, per chip of a (data, model) mesh; and the refusal of a run that does not fit.

- Weights: every param of the models the mode runs (target; the draft and the EAGLE-3 head where the mode runs
  them), each divided over the mesh axes its `NamedSharding` splits it on (`models.sharding`).
- KV caches: layers x 2 x rows x KV heads x slots x head_dim in the config's dtype, the slots being the cache the
  mode's program allocates (the same buckets as the programs: `runtime.programs.bucket` / `length_bucket`); rows
  split over `data`, KV heads over `model`. A served run (continuous batching: more prompts than `batch`, in a
  mode that serves) holds its slots' caches and, while it admits, the admitted rows' own (an admission prefills or
  verifies up to a slot bucket of prompts before moving them in); a run that verifies ahead of its free slots
  (single-round parse and parse+eagle3, sequential: `modes/verified_slots`) also holds its park of verified rows
  (B - 1), so its target and EAGLE-3 caches hold 3B - 1 rows. Where the schedule may run multi or single round
  (`ParseConfig.rounds="auto"`), the plan is the larger.
- Activations: the peak of the largest pass (T tokens of B rows over S slots) of the models: the largest of the
  pass's phases, whose buffers are never live together, each beside the residual stream [B, T, hidden]: attention
  (with attention_impl "xla" the dense float32 scores and probabilities [B, H, T, S]; with the Pallas kernels, which
  keep their tiles on chip, q and the output), the MLP (its normed input, gate and up [B, T, I]) and the float32
  logits [B, T, V]. This is
  what XLA's buffer assignment keeps on CPU (tests/lowering/test_memory.py compares it with
  `compiled.memory_analysis()`).

`MemoryPlan.line()` is the one-line verdict, naming the sizes and what would fit instead (a smaller batch, a shorter
budget, or a mesh with a larger `model` axis).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, AxisType

import pallas_kernels
from parse_jax.errors import ConfigError
from parse_jax.lowering.chips import Chip
from parse_jax.models.config import ModelConfig
from parse_jax.models.sharding import abstract_params, fitting_rules
from parse_jax.modes.parse_multi import eagle_spec, multi_shape
from parse_jax.modes.table import MODE_TABLE
from parse_jax.runtime.programs import bucket, length_bucket
from parse_jax.verify.round import block_lengths

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What a run allocates, per model: (name, config, cache slots or 0, tokens of its largest pass, cache rows);
    `batch` the rows of its largest pass."""

    batch: int
    models: tuple[tuple[str, ModelConfig, int, int, int], ...]
    dense_attention: bool


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per chip (one device of the mesh)."""

    chip: str
    capacity: int
    mesh: dict[str, int]
    batch: int
    prompt_len: int
    max_new_tokens: int
    weights: int
    caches: int
    activations: int
    per_model: dict[str, dict[str, int]]
    alternatives: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.weights + self.caches + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def line(self) -> str:
        d, m = self.mesh.get("data", 1), self.mesh.get("model", 1)
        where = f"a {self.chip} chip ({_size(self.capacity, 1)})" + (f" of a data={d},model={m} mesh"
                                                                     if d * m > 1 else "")
        sizes = (f"weights {_size(self.weights)} + KV caches {_size(self.caches)} + activations "
                 f"{_size(self.activations)} = {_size(self.total)}")
        run = f"batch {self.batch} x {self.prompt_len} prompt + {self.max_new_tokens} new tokens"
        if self.fits:
            return f"{run} fits {where}: {sizes}"
        instead = "; ".join(self.alternatives) if self.alternatives else "nothing smaller fits"
        return f"{run} does not fit {where}: {sizes}; what would fit: {instead}"

    def as_dict(self) -> dict[str, Any]:
        return {"chip": self.chip, "capacity_bytes": self.capacity, "mesh": self.mesh, "batch": self.batch,
                "weights_bytes": self.weights, "kv_cache_bytes": self.caches, "activation_bytes": self.activations,
                "total_bytes": self.total, "fits": self.fits, "per_model": self.per_model,
                "alternatives": list(self.alternatives), "line": self.line()}


def _size(n: int, digits: int = 2) -> str:
    """GB (10^9 bytes), or MB below a hundredth of one (small models would read 0.00 GB)."""
    return f"{n / GB:.{digits}f} GB" if n >= GB / 10**digits else f"{n / 1e6:.{digits}f} MB"


def run_shapes(ctx, mode: str, batch: int, prompt_len: int, max_new: int, platform: str = "tpu", *,
               rounds: str | None = None, served: bool = False) -> Shapes:
    """The caches and largest passes of `mode` for `batch` prompts of `prompt_len` tokens and `max_new` new ones,
    bucketed as the mode's programs bucket them (modes/*.py, speculation/*.py), on `platform` (whether the target's
    attention_impl is dense there). `rounds`: multi or single (default: the mode's name, else the config's);
    `served`: `batch` slots kept busy over more prompts (the module docstring's cache rows)."""
    cfg = ctx.config
    b, p, n = bucket(batch, 1), bucket(prompt_len), bucket(max_new, 16)
    t, dcfg = ctx.target.config, (ctx.draft.config if ctx.draft is not None else None)
    suffix = len(ctx.suffix_ids)
    d = bucket(min(cfg.max_draft_tokens, max_new), 16)
    cap = lambda s, c: min(s, c.max_position_embeddings)  # noqa: E731
    models: list[tuple[str, ModelConfig, int, int]] = []
    if rounds is None:
        rounds = "multi" if mode == "parse-multi" else ("single" if mode == "parse-single" else cfg.rounds)
    if mode == "target":
        models.append(("target", t, cap(length_bucket(p + n), t), p))
    elif mode in ("sd", "eagle3"):
        extra = cfg.speculation.gamma + 1 if mode == "sd" else eagle_spec(ctx).loop_slots  # a round's writes
        slots = length_bucket(p + n + extra)
        models.append(("target", t, cap(slots, t), p))
        if mode == "sd":
            models.append(("draft", dcfg, cap(slots, dcfg), p))
        else:
            models.append(("eagle3", ctx.head.config.layer, slots, p))
    elif mode == "sequential":
        lengths = block_lengths(d + suffix)
        models.append(("target", t, length_bucket(max(p + d + lengths[-1], p + max_new + 1)), p))
        models.append(("draft", dcfg, length_bucket(p + d), p))
    elif mode == "prefix_scores":
        k = max(1, min(cfg.max_prefixes, max_new))
        slots = bucket(prompt_len + max_new + k * suffix)
        models.append(("target", t, slots, slots))
    elif rounds == "multi":  # parse, parse+eagle3
        eagle = eagle_spec(ctx) if mode == "parse+eagle3" else None
        shape = multi_shape(ctx, p, max_new, eagle)  # the caches the program allocates
        models.append(("target", t, shape.cache_len, shape.first_lengths[-1]))
        models.append(("draft", dcfg, shape.cache_len, p))
        if eagle is not None:
            models.append(("eagle3", ctx.head.config.layer, shape.cache_len, shape.first_lengths[-1]))
    else:  # parse single, parse+eagle3
        eagle = mode == "parse+eagle3"
        lengths = block_lengths(p + d + ctx.round_spec.max_prefixes * suffix)
        margin = eagle_spec(ctx).loop_slots if eagle else 1  # an EAGLE-3 round writes past its last token
        models.append(("target", t, length_bucket(max(lengths[-1], p + max_new + margin)), lengths[-1]))
        models.append(("draft", dcfg, length_bucket(p + d), p))
        if eagle:
            models.append(("eagle3", ctx.head.config.layer, length_bucket(max(lengths[-1], p + max_new + margin)),
                           margin))
    backend = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    dense = pallas_kernels.resolve(getattr(ctx.target, "attention_impl", "xla"), backend, interpret=True)[0] == "xla"
    spec = MODE_TABLE.get(mode.removesuffix("-single"))
    ahead = spec is not None and spec.serves_ahead and (rounds != "multi" or not spec.honours_rounds)
    return Shapes(b, tuple((*m, cache_rows(m[0], b, served=served, ahead=ahead)) for m in models), dense)


def cache_rows(model: str, slots: int, *, served: bool, ahead: bool) -> int:
    """The cache rows a run over `slots` rows holds of `model`'s cache: its batch; served, its slots and an
    admission's rows (up to the slot bucket); verifying ahead (`modes/verified_slots`), where only the verification
    drafts, also the park's B - 1 rows of the target's and the head's cache, and the draft's rows only in the
    admission."""
    if not served:
        return slots
    if not ahead:
        return 2 * slots
    return slots if model == "draft" else 3 * slots - 1


def _mesh(sizes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh((sizes.get("data", 1), sizes.get("model", 1)), ("data", "model"),
                        axis_types=(AxisType.Auto,) * 2)


def weight_bytes(cfg: ModelConfig, sizes: dict[str, int], fallback_replicated: bool = False) -> int:
    """Bytes of `cfg`'s params on one chip of the mesh (each param divided over the axes it is split on)."""
    return _weight_bytes(cfg, sizes.get("data", 1), sizes.get("model", 1), fallback_replicated)


@functools.lru_cache(maxsize=256)
def _weight_bytes(cfg: ModelConfig, data: int, model: int, fallback_replicated: bool) -> int:
    sizes = {"data": data, "model": model}
    mesh = _mesh(sizes)
    params = abstract_params(cfg, mesh, fitting_rules(cfg, mesh, fallback_replicated))
    total = 0
    for leaf in _leaves(params):
        split = 1
        for axis in leaf.sharding.spec:
            if axis is not None:
                split *= int(mesh.shape[axis])
        total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize // split
    return total


def _leaves(tree: Any) -> list:
    import jax

    return jax.tree.leaves(tree)


def _split(n: int, parts: int) -> float:
    return n / parts if parts > 1 and n % parts == 0 else float(n)


def estimate(shapes: Shapes, sizes: dict[str, int], head_weights: int = 0) -> dict[str, dict[str, int]]:
    """Per model: weights, KV cache and largest-pass activation bytes on one chip."""
    data, model = sizes.get("data", 1), sizes.get("model", 1)
    rows = _split(shapes.batch, data)
    out = {}
    for name, cfg, slots, tokens, held in shapes.models:
        item = np.dtype(cfg.dtype).itemsize
        kv = _split(cfg.num_kv_heads, model)
        heads = _split(cfg.num_heads, model)
        cache = cfg.num_layers * 2 * _split(held, data) * kv * slots * cfg.head_dim * item
        bt = rows * tokens
        # the largest pass's peak: the largest of its phases, whose buffers are never live together; each keeps the
        # residual stream [B, T, hidden] alive
        residual = bt * cfg.hidden_size * item
        if shapes.dense_attention:  # scores and probabilities, float32 [B, H, T, S]
            attention = residual + 2 * rows * heads * tokens * max(slots, tokens) * 4
        else:  # the kernel's q and output; its tiles stay on chip
            attention = residual + 2 * bt * heads * cfg.head_dim * item
        mlp = 2 * residual + 2 * bt * _split(cfg.intermediate_size, model) * item  # gate and up (the product fuses)
        logits = residual + bt * _split(cfg.vocab_size, model) * 4  # float32 (the cast fuses into the LM head)
        act = max(attention, mlp, logits)
        weights = head_weights if name == "eagle3" else weight_bytes(cfg, sizes, fallback_replicated=name != "target")
        out[name] = {"weights": int(weights), "kv_cache": int(cache), "activations": int(act)}
    return out


def _plan(shapes: Shapes, target: Chip, sizes: dict[str, int], capacity: int, head_weights: int,
          run: tuple[int, int, int]) -> MemoryPlan:
    per = estimate(shapes, sizes, head_weights)
    weights = sum(v["weights"] for v in per.values())
    caches = sum(v["kv_cache"] for v in per.values())
    acts = max(v["activations"] for v in per.values())  # the passes run one after another
    return MemoryPlan(target.name, capacity, dict(sizes), run[0], run[1], run[2], weights, caches, acts, per)


def plan_memory(ctx, mode: str, req, target: Chip, sizes: dict[str, int] | None = None,
                capacity: int | None = None, batch: int | None = None,
                rounds: tuple[str | None, ...] = (None,)) -> MemoryPlan:
    """The memory plan of `mode` over the validated request `req` on `target` chips (`capacity` bytes each; default
    the chip table's HBM), with what would fit when it does not. `batch`: the rows run at once (default every
    prompt of `req`; fewer under `generate(..., max_batch=)`, a served run where the mode serves), each as long as
    the longest prompt. `rounds`: those the run may take (`schedule="auto"` over `rounds="auto"`: multi and single;
    None: the context's); the plan is the largest. A smaller batch offered instead is, where `batch` is given,
    `max_batch` over the same prompts (a served run, as `generate` takes it); without it, that many prompts alone
    (what `parse-jax lower --batch-size` means)."""
    given = batch is not None  # a smaller batch offered is then max_batch over the same prompts (served)
    sizes = dict(sizes or {"data": 1, "model": 1})
    capacity = int(capacity if capacity is not None else target.hbm_bytes)
    batch, prompt_len = batch or len(req.ids), max(len(x) for x in req.ids)
    head_weights = 0
    if ctx.head is not None and mode in ("eagle3", "parse+eagle3"):
        head_weights = sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
                           for x in _leaves(ctx.head.params))

    spec = MODE_TABLE.get(mode)
    serves = given and spec is not None and spec.serve is not None and getattr(ctx.target, "mesh", None) is None

    def at(b: int, n: int, s: dict[str, int]) -> MemoryPlan:
        """The plan of `b` rows at once (served where fewer than the prompts and a batch was given:
        `generate(..., max_batch=b)`), the largest of the rounds the run may take."""
        plans = [_plan(run_shapes(ctx, mode, b, prompt_len, n, target.platform, rounds=r,
                                  served=serves and b < len(req.ids)), target, s, capacity, head_weights,
                       (b, prompt_len, n)) for r in rounds]
        return max(plans, key=lambda x: x.total)

    plan = at(batch, req.max_new, sizes)
    if plan.fits:
        return plan
    options = []
    b = batch
    while b > 1 and not at(b, req.max_new, sizes).fits:
        b //= 2
    if b < batch and at(b, req.max_new, sizes).fits:
        options.append(f"batch {b}")
    n = req.max_new
    while n > 16 and not at(batch, n, sizes).fits:
        n //= 2
    if n < req.max_new and at(batch, n, sizes).fits:
        options.append(f"max_new_tokens {n}")
    for m in (2, 4, 8, 16, 32, 64):
        bigger = {"data": sizes.get("data", 1), "model": sizes.get("model", 1) * m}
        try:
            if at(batch, req.max_new, bigger).fits:
                options.append(f"a mesh data={bigger['data']},model={bigger['model']}")
                break
        except ConfigError:  # heads that do not divide over this model axis
            continue
    return dataclasses.replace(plan, alternatives=tuple(options))


def device_capacity(device: Any, table_chip: Chip | None) -> int | None:
    """Bytes a real device offers a run: its allocator's limit (`memory_stats()["bytes_limit"]`), else the chip
    table's HBM for its kind, else None (a CPU: no plan)."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return table_chip.hbm_bytes if table_chip is not None else None


class MemoryGuard:
    """The memory check of the library path (`ParseEngine.generate`): a real device's capacity, read once
    (`device_capacity`; default device: the first one), and one plan per run shape (mode, rows, longest prompt,
    budget), cached. On a device without a capacity (a CPU) nothing is planned: a run there costs one attribute
    read. `device`: any object with `device_kind`, `platform` and `memory_stats()`, as `jax.devices()[0]`."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self._target: Chip | None = None
        self._read = False
        self._plans: dict[tuple, MemoryPlan] = {}

    def target(self) -> Chip | None:
        """The device as a chip whose HBM is what its allocator offers (None: no capacity, a CPU)."""
        if not self._read:
            import jax

            from parse_jax.lowering.chips import chip_of_device_kind

            device = self.device if self.device is not None else jax.devices()[0]
            kind = getattr(device, "device_kind", "")
            table = chip_of_device_kind(kind)
            capacity = device_capacity(device, table)
            if capacity is not None:
                name = table.name if table is not None else kind or "device"
                platform = table.platform if table is not None else getattr(device, "platform", "?")
                self._target = Chip(name, platform, kind, table.num_cores if table else 1, capacity)
            self._read = True
        return self._target

    def plan(self, ctx, mode: str, req, batch: int | None = None,
             rounds: tuple[str | None, ...] = (None,)) -> MemoryPlan | None:
        """The plan of `mode` over `req` at `batch` rows, taking any of `rounds` (`plan_memory`), on this device (one
        chip of the target's mesh, when it has one); None without a capacity."""
        target = self.target()
        if target is None:
            return None
        batch = batch or len(req.ids)
        key = (mode, batch, batch < len(req.ids), rounds, max(len(x) for x in req.ids), req.max_new)
        if key not in self._plans:
            mesh = getattr(ctx.target, "mesh", None)
            sizes = {"data": int(mesh.shape["data"]), "model": int(mesh.shape["model"])} if mesh is not None else None
            if len(self._plans) >= 256:  # a long-lived server meets many prompt lengths: keep the cache bounded
                self._plans.clear()
            self._plans[key] = plan_memory(ctx, mode, req, target, sizes, capacity=target.hbm_bytes, batch=batch,
                                           rounds=rounds)
        return self._plans[key]

    def check(self, ctx, mode: str, req, batch: int | None = None,
              rounds: tuple[str | None, ...] = (None,)) -> MemoryPlan | None:
        """`plan`, refusing (`check_fits`: one line) a run that does not fit."""
        plan = self.plan(ctx, mode, req, batch, rounds)
        return check_fits(plan) if plan is not None else None


def device_plan(ctx, mode: str, req, device: Any = None) -> MemoryPlan | None:
    """The plan of `mode` over `req` on a real device (default: the first one), whose capacity is what its allocator
    offers (`device_capacity`); a mesh target plans one chip of its mesh. None on a device without a capacity (a
    CPU)."""
    return MemoryGuard(device).plan(ctx, mode, req)


def check_fits(plan: MemoryPlan) -> MemoryPlan:
    """Refuse, with `plan.line()`, a run that does not fit (before anything is allocated)."""
    if not plan.fits:
        raise ConfigError(plan.line())
    return plan
