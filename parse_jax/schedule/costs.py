"""What one forward pass of a model costs, in seconds, as a function of (batch rows, tokens per pass, cache length).

Two sources with one interface (`seconds(batch, tokens, cache_len)`):

- `Roofline`: no measurement. A pass reads the weights once and every row's KV cache buffer, and does the block's
  matmul FLOPs: `time = max(bytes / bandwidth, flops / matmul_rate) + dispatch`, from the model config and a table
  of devices keyed by `jax.devices()[0].device_kind` (`DEVICES`). The cache term is the whole buffer (`cache_len`
  slots): the XLA attention reads and scores every slot and masks the uncommitted ones.
- `CostTable`: a measured grid (`parse_jax.schedule.profile`), interpolated linearly in batch, tokens and cache
  length (a pass costs about an affine function of each, so linear beats log-linear between octave grid points:
  log-linear overstates a 48-token pass by 6% between 32 and 64); past the largest tokens it grows in proportion
  (a compute-bound pass), past the largest batch or cache along the last segment's slope.

`PassCosts` holds one per model a generation runs: the target, the draft, an EAGLE-3 head (each optional but the
target). Nothing here compiles or runs a model.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Literal, Protocol

from parse_jax.errors import ConfigError
from parse_jax.models.config import ModelConfig
from parse_jax.utils.validation import check_float, check_int

Role = Literal["target", "draft", "eagle3"]
ROLES: tuple[str, ...] = ("target", "draft", "eagle3")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class PassCost(Protocol):
    def seconds(self, batch: int, tokens: int, cache_len: int) -> float: ...


@dataclasses.dataclass(frozen=True)
class Device:
    """Peak memory bandwidth (bytes/s), matmul rate (FLOP/s) per dtype, and the fixed cost of dispatching one
    pass (`overhead_s`) plus one layer of it (`layer_overhead_s`: kernel launches, XLA:CPU thunks)."""

    name: str
    bandwidth: float
    flops_bf16: float
    flops_f32: float
    overhead_s: float
    layer_overhead_s: float

    def flops(self, dtype: str) -> float:
        return self.flops_bf16 if dtype == "bfloat16" else self.flops_f32


# Public peak figures (dense matmul, no sparsity); f32 on accelerators is the TF32 / bf16-pass rate XLA uses by
# default. CPU: a 2-core AVX2 share, checked against `profile` on the embedded pair (docs/design.md §6: XLA:CPU
# bfloat16 matmuls are several times slower than float32). Keys are lower-case substrings of `device_kind`, tried in
# order (the more specific first). The CPU's were fitted to the embedded target in float32 on an idle 2-core
# EPYC: 6.4 ms for a one-token step (64 MB read: ~10 GB/s), 246 ms for batch 16 x 32 tokens (16.5 GFLOP: ~65
# GFLOP/s), 0.21 ms for a step of the 3-layer draft (dispatch).
DEVICES: dict[str, Device] = {
    "h200": Device("NVIDIA H200", 4.8e12, 989e12, 495e12, 20e-6, 4e-6),
    "h100": Device("NVIDIA H100", 3.35e12, 989e12, 495e12, 20e-6, 4e-6),
    "a100": Device("NVIDIA A100", 2.0e12, 312e12, 156e12, 20e-6, 5e-6),
    "tpu v5 lite": Device("TPU v5e", 819e9, 197e12, 98e12, 30e-6, 2e-6),
    "tpu v5e": Device("TPU v5e", 819e9, 197e12, 98e12, 30e-6, 2e-6),
    "tpu v5p": Device("TPU v5p", 2.765e12, 459e12, 229e12, 30e-6, 2e-6),
    "tpu v5": Device("TPU v5p", 2.765e12, 459e12, 229e12, 30e-6, 2e-6),
    "tpu v6 lite": Device("TPU v6e", 1.64e12, 918e12, 459e12, 30e-6, 2e-6),
    "tpu v6e": Device("TPU v6e", 1.64e12, 918e12, 459e12, 30e-6, 2e-6),
    "tpu v4": Device("TPU v4", 1.2e12, 275e12, 137e12, 30e-6, 2e-6),
    "cpu": Device("CPU (2-core AVX2 share)", 10e9, 16e9, 65e9, 50e-6, 35e-6),
}


def device_for(kind: str) -> Device:
    """The `DEVICES` entry whose key is in `kind` (case-insensitive); an unknown kind gets the CPU's figures under
    its own name (a slow guess is safe: it only makes speculation look worse than it may be)."""
    low = kind.lower()
    for key, device in DEVICES.items():
        if key in low:
            return device
    return dataclasses.replace(DEVICES["cpu"], name=f"unknown ({kind})")


def current_device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model: weights read per pass, matmul FLOPs per token, KV bytes per cached slot
    and row, attention FLOPs per (token, slot), layers and dtype."""

    weight_bytes: float
    matmul_flops_per_token: float
    kv_bytes_per_slot: float
    attn_flops_per_slot: float
    layers: int
    dtype: str

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelShape:
        """A decoder of `cfg`: every matrix is read and multiplied once per token; the embedding lookup reads only
        the block's rows, unless it is tied (then it is the LM head and read whole)."""
        h, v, width = cfg.hidden_size, cfg.vocab_size, DTYPE_BYTES[cfg.dtype]
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        layer = 2 * h * q + 2 * h * kv + 3 * h * cfg.intermediate_size
        matmul = cfg.num_layers * layer + h * v
        read = cfg.num_params - (0 if cfg.tie_word_embeddings else v * h)
        return cls(weight_bytes=read * width, matmul_flops_per_token=2.0 * matmul,
                   kv_bytes_per_slot=2.0 * cfg.num_layers * kv * width,
                   attn_flops_per_slot=4.0 * cfg.num_layers * q, layers=cfg.num_layers, dtype=cfg.dtype)

    @classmethod
    def of_eagle3(cls, layer: ModelConfig) -> ModelShape:
        """An EAGLE-3 head of one decoder layer `layer` (the target's width): its q/k/v read a 2d-wide input and a
        3d -> d fusion precedes it; the target's LM head is shared (read once per pass)."""
        h, width = layer.hidden_size, DTYPE_BYTES[layer.dtype]
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        matmul = 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * layer.intermediate_size + h * layer.vocab_size
        return cls(weight_bytes=matmul * width, matmul_flops_per_token=2.0 * matmul,
                   kv_bytes_per_slot=2.0 * kv * width, attn_flops_per_slot=4.0 * q, layers=1, dtype=layer.dtype)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The analytic cost of a pass of `shape` on `device` (see the module docstring)."""

    shape: ModelShape
    device: Device

    def seconds(self, batch: int, tokens: int, cache_len: int) -> float:
        s, d = self.shape, self.device
        memory = (s.weight_bytes + batch * cache_len * s.kv_bytes_per_slot) / d.bandwidth
        flops = batch * tokens * (s.matmul_flops_per_token + cache_len * s.attn_flops_per_slot)
        return max(memory, flops / d.flops(s.dtype)) + d.overhead_s + s.layers * d.layer_overhead_s


def roofline(cfg: ModelConfig, kind: str | None = None, eagle3: bool = False) -> Roofline:
    """The roofline of a model (or, with `eagle3`, of an EAGLE-3 head whose layer is `cfg`) on the device of
    `kind` (default: this process's first device)."""
    shape = ModelShape.of_eagle3(cfg) if eagle3 else ModelShape.of(cfg)
    return Roofline(shape, device_for(current_device_kind() if kind is None else kind))


def check_axes(obj: Any, what: str) -> None:
    """Set `obj`'s batches / tokens / caches (a frozen dataclass) to tuples of strictly increasing positive ints."""
    for name in ("batches", "tokens", "caches"):
        axis = tuple(check_int(f"{what} {name}", x, 1) for x in getattr(obj, name))
        if not axis or list(axis) != sorted(set(axis)):
            raise ConfigError(f"{what} {name} must be strictly increasing positive integers, got {axis}")
        object.__setattr__(obj, name, axis)


def _segment(axis: tuple[float, ...], x: float) -> tuple[int, float]:
    """(i, w): x lies w of the way from axis[i] to axis[i + 1]; w < 0 below the grid is clamped to 0, w > 1 above
    it extrapolates along the last segment. A one-point axis gives (0, 0)."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    w = (x - axis[i]) / (axis[i + 1] - axis[i])
    return i, max(w, 0.0)


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Measured seconds per pass on a grid: `seconds_grid[i][j][k]` at (batches[i], tokens[j], caches[k]).

    `measured` says which points were timed; the others (passes too long for the profile's budget) were filled in
    proportion to tokens from the largest timed one of their row. `meta`: what was measured (model, device)."""

    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    caches: tuple[int, ...]
    seconds_grid: tuple[tuple[tuple[float, ...], ...], ...]
    measured: tuple[tuple[tuple[bool, ...], ...], ...] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_axes(self, "cost table")
        shape = (len(self.batches), len(self.tokens), len(self.caches))
        grid = tuple(tuple(tuple(float(x) for x in row) for row in plane) for plane in self.seconds_grid)
        if len(grid) != shape[0] or any(len(p) != shape[1] or any(len(r) != shape[2] for r in p) for p in grid):
            raise ConfigError(f"cost table seconds_grid must have shape {list(shape)} (batches x tokens x caches)")
        for plane in grid:
            for row in plane:
                for x in row:
                    check_float("cost table seconds", x, 0.0, min_open=True)
        object.__setattr__(self, "seconds_grid", grid)
        if self.measured is not None:
            measured = tuple(tuple(tuple(bool(x) for x in r) for r in p) for p in self.measured)
            if len(measured) != shape[0] or any(len(p) != shape[1] or any(len(r) != shape[2] for r in p)
                                                for p in measured):
                raise ConfigError(f"cost table measured must have shape {list(shape)} (batches x tokens x caches)")
            object.__setattr__(self, "measured", measured)

    def seconds(self, batch: int, tokens: int, cache_len: int) -> float:
        """Trilinear interpolation; past the largest tokens in proportion to tokens; past the largest batch or cache
        along the last segment, never below the grid's edge (a profile keeps a larger shape that timed faster, and
        that segment's slope must not take a cost to zero or below)."""
        over = max(tokens / self.tokens[-1], 1.0)
        tokens = min(tokens, self.tokens[-1])
        edge = self._interpolated(min(batch, self.batches[-1]), tokens, min(cache_len, self.caches[-1]))
        return max(self._interpolated(batch, tokens, cache_len), edge) * over

    def _interpolated(self, batch: int, tokens: int, cache_len: int) -> float:
        (i, wi), (j, wj), (k, wk) = (_segment(self.batches, batch), _segment(self.tokens, tokens),
                                     _segment(self.caches, cache_len))
        total = 0.0
        for di, fi in ((0, 1 - wi), (1, wi)):
            for dj, fj in ((0, 1 - wj), (1, wj)):
                for dk, fk in ((0, 1 - wk), (1, wk)):
                    if fi and fj and fk:
                        total += fi * fj * fk * self.seconds_grid[i + di][j + dj][k + dk]
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"batches": list(self.batches), "tokens": list(self.tokens), "caches": list(self.caches),
                "seconds": [[list(r) for r in p] for p in self.seconds_grid],
                "measured": None if self.measured is None else [[list(r) for r in p] for p in self.measured],
                "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostTable:
        try:
            return cls(batches=tuple(d["batches"]), tokens=tuple(d["tokens"]), caches=tuple(d["caches"]),
                       seconds_grid=d["seconds"], measured=d.get("measured"), meta=dict(d.get("meta", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed cost table: {type(e).__name__}: {e}") from None


@dataclasses.dataclass(frozen=True)
class PassCosts:
    """The pass costs of the models one generation runs; `draft` / `eagle3` None when there is none.
    `sources` says where each came from ("roofline" or "profile")."""

    target: PassCost
    draft: PassCost | None = None
    eagle3: PassCost | None = None

    def seconds(self, role: Role, batch: int, tokens: int, cache_len: int) -> float:
        cost = getattr(self, role)
        if cost is None:
            raise ConfigError(f"no {role} pass cost in this cost model (it has: "
                              f"{', '.join(r for r in ROLES if getattr(self, r) is not None)})")
        return cost.seconds(batch, tokens, cache_len)

    @property
    def sources(self) -> dict[str, str]:
        return {r: "profile" if isinstance(c, CostTable) else "roofline"
                for r in ROLES if (c := getattr(self, r)) is not None}
