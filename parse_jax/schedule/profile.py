"""A short profile of what forward passes cost on this device, cached on disk beside the compile cache.

`profile_model` times jitted passes of a `Model` (the same decoder call every mode runs) on a grid of (batch,
tokens per pass, cache length): every shape compiled first (compile excluded), then `rounds` passes over the whole
grid, each timing every shape's median of `repeats` passes (after `WARMUP` untimed ones in the first round, one
after); a shape's figure is the median of its rounds, so a slow spell of the machine (another process on the cores,
seconds to minutes) costs one round of each shape it meets, not every timing of the few shapes it falls on. A pass
slower than the same one with more rows, more tokens or a longer cache is timed again. Passes of more than
`max_block_tokens` rows x tokens are not timed (on a CPU they are compute-bound: seconds each); `CostTable` fills
them in proportion to tokens. The embedded pair's whole profile (`Grid()` for the target, `DRAFTER_GRID` for the
draft and the head: 210 shapes, 126 of them the target's) is compilation (about a second per shape of the 8-layer
target on an idle 2-core CPU, less from a warm compile cache) and about 13 timed or warm-up passes per shape (about
170 s of the target's 378 s on a slow hour: benchmarks/results/profile_pair_default); `pass_costs(measure=True)` runs
it once and caches it.

Tables are JSON files in `profiles/` next to the persistent compile cache (`profiles_dir`), named by a fingerprint
of the model (config and param shapes/dtypes), the device kind and count (on a CPU, the processor too:
`utils/host.cpu_identity`), the jax/jaxlib/parse-jax versions and the grid; a file whose stored fingerprint
differs is never used. A profile is never required: `load_or_profile` returns None when there is none (and
`measure` is off), and `pass_costs` then falls back to the roofline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import causal_metadata
from parse_jax.models.model import Model, decoder_fn, init_params, param_shapes
from parse_jax.schedule.costs import CostTable, PassCosts, check_axes, current_device_kind, roofline
from parse_jax.utils import atomic, compile_cache
from parse_jax.utils.host import cpu_identity
from parse_jax.utils.progress import bar, logger
from parse_jax.utils.validation import check_int
from parse_jax.utils.version import package_version

FORMAT = 3  # bump when the file layout or what is measured changes (2: `WARMUP` passes, suspects re-timed;
#            3: rounds over the whole grid, suspects in tokens too)
WARMUP = 2  # untimed passes after compiling: the first ones after a compile ran up to 40% slower on a CPU


@dataclasses.dataclass(frozen=True)
class Grid:
    """Where to measure: every (batch, tokens, cache) with batch x tokens <= `max_block_tokens` (tokens 1 always)."""

    # the batch sizes the commands run (eval's default 8 among them), and the tokens per pass and cache lengths
    # programs run: one token (decode steps) and the verification blocks' length buckets
    # (`runtime/programs.length_bucket`). Between such points a pass's cost on a CPU need not be the line between
    # them: XLA compiles each shape to its own kernels (benchmarks/results/cost_model: at batch 64, cache 256, 12
    # tokens 313.0 ms against 16 tokens' 312.6, the median of three runs)
    batches: tuple[int, ...] = (1, 4, 8, 16, 64)
    tokens: tuple[int, ...] = (1, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    caches: tuple[int, ...] = (128, 256, 512)
    max_block_tokens: int = 1024
    repeats: int = 3  # timed passes of a shape per round (their median is the round's figure)
    rounds: int = 3   # passes over the whole grid (a shape's figure: the median of its rounds')

    def __post_init__(self) -> None:
        check_axes(self, "profile grid")
        object.__setattr__(self, "max_block_tokens", check_int("max_block_tokens", self.max_block_tokens, 1))
        object.__setattr__(self, "repeats", check_int("repeats", self.repeats, 1, 100))
        object.__setattr__(self, "rounds", check_int("rounds", self.rounds, 1, 100))

    def timed(self, batch: int, tokens: int) -> bool:
        return tokens == 1 or batch * tokens <= self.max_block_tokens


# Drafters (a draft model, an EAGLE-3 head) are small: one cache length is enough (their cost barely moves with it),
# and halves the compilations of a profile.
DRAFTER_GRID = Grid(caches=(256,))


def profiles_dir() -> Path:
    """`profiles/` beside the persistent compile cache's default folder (~/.cache/parse-jax/profiles)."""
    return compile_cache.default_dir().parent / "profiles"


def model_fingerprint(model: Model) -> dict[str, Any]:
    """What any measurement of `model` here depends on: its config and param shapes, the device (on a CPU, the
    processor), the library versions, and on a mesh its shape and each param's partition (a table timed under one
    layout is not another's). JSON-shaped, as it reads back from a file (lists, not tuples)."""
    import jaxlib

    leaves = jax.tree_util.tree_flatten_with_path(model.params)[0]
    params = sorted([jax.tree_util.keystr(path), list(np.shape(x)), str(np.dtype(x.dtype))] for path, x in leaves)
    key = {"config": model.config.to_dict(), "attention_impl": model.attention_impl, "params": params,
           "device_kind": current_device_kind(), "device_count": jax.device_count(), "jax": jax.__version__,
           "jaxlib": jaxlib.__version__, "parse_jax": package_version()}
    mesh = getattr(model, "mesh", None)
    if mesh is not None:  # unsharded models keep the key they had
        key["mesh"] = {str(axis): int(n) for axis, n in mesh.shape.items()}
        key["partition"] = sorted([jax.tree_util.keystr(path), str(getattr(getattr(x, "sharding", None), "spec", None))]
                                  for path, x in leaves)
    if jax.devices()[0].platform == "cpu":  # jax names every processor "cpu"
        key["host"] = cpu_identity()
    return json.loads(json.dumps(key))


def fingerprint(model: Model, grid: Grid) -> dict[str, Any]:
    """Everything a table depends on: a different model, device (on a CPU, processor), library version, file
    format or grid measures anew."""
    return {"format": FORMAT, **model_fingerprint(model), "grid": json.loads(json.dumps(dataclasses.asdict(grid)))}


def profile_path(key: dict[str, Any], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (profiles_dir() if folder is None else Path(folder)) / f"{digest}.json"


def _pass_timer(model: Model, batch: int, tokens: int, cache_len: int) -> Callable[[int, int], float]:
    """Compile one pass of `tokens` new tokens per row over a cache of `cache_len` slots (the block written at its
    end) and return `timer(repeats, warmup)`: the median seconds of `repeats` passes after `warmup` untimed ones.
    Compilation is never timed; each call builds its own cache (the pass donates it), so timers can be called in any
    order without holding every shape's cache at once."""
    fn = decoder_fn(model.config, model.attention_impl, False)
    positions = (cache_len - tokens) + jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32)[None, :],
                                                        (batch, tokens))
    ids = jnp.zeros((batch, tokens), jnp.int32)
    limit, group = causal_metadata(batch, tokens)

    def new_cache():
        return model.init_cache(batch, cache_len).set_lengths(jnp.full((batch,), cache_len - tokens, jnp.int32))

    compiled = fn.lower(model.params, ids, positions, new_cache(), limit, group).compile()

    def timer(repeats: int, warmup: int) -> float:
        cache, times = new_cache(), []
        for i in range(repeats + warmup):
            start = time.perf_counter()
            logits, cache, _ = compiled(model.params, ids, positions, cache, limit, group)
            logits.block_until_ready()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    return timer


def _time_pass(model: Model, batch: int, tokens: int, cache_len: int, repeats: int) -> float:
    """Median seconds of `repeats` passes of one shape, compiled and timed now (after `WARMUP` untimed passes)."""
    return _pass_timer(model, batch, tokens, cache_len)(repeats, WARMUP)


def profile_model(model: Model, grid: Grid = Grid()) -> CostTable:
    """Time `model`'s passes on `grid` in rounds (see the module docstring), then time again each pass that took
    longer than the same pass with more rows, more tokens or over a longer cache (`_suspects`), keeping the lower
    figure. A model whose params are shapes (`head_model`'s) is timed with random ones."""
    model = _with_weights(model)
    shapes = [((i, j, k), (b, t, max(c, t))) for i, b in enumerate(grid.batches) for j, t in enumerate(grid.tokens)
              if grid.timed(b, t) for k, c in enumerate(grid.caches)]
    # minutes on a CPU: a bar over each shape's compile and each round's timing (shown where phases are)
    with bar(total=len(shapes) * (1 + grid.rounds), desc="profiling passes", unit="step") as progress:
        timers = {}
        for key, shape in shapes:
            timers[key] = _pass_timer(model, *shape)
            progress.update()
        rounds = []
        for r in range(grid.rounds):
            rounds.append({})
            for key, timer in timers.items():
                rounds[-1][key] = timer(grid.repeats, WARMUP if r == 0 else 1)
                progress.update()
    timed = {key: statistics.median(one[key] for one in rounds) for key in timers}
    for key in _suspects(timed):
        timed[key] = min(timed[key], timers[key](grid.repeats, 1))
    seconds, measured = [], []
    for i in range(len(grid.batches)):
        plane = [[timed.get((i, j, k)) for k in range(len(grid.caches))] for j in range(len(grid.tokens))]
        mask = [[x is not None for x in row] for row in plane]
        last = 0
        for j, t in enumerate(grid.tokens):  # untimed passes: in proportion to tokens from the last timed one
            if mask[j][0]:
                last = j
            else:
                plane[j] = [x * t / grid.tokens[last] for x in plane[last]]
        seconds.append(plane)
        measured.append(mask)
    meta = {"device_kind": current_device_kind(), "model": repr(model), "repeats": grid.repeats, "rounds": grid.rounds}
    return CostTable(grid.batches, grid.tokens, grid.caches, seconds, measured, meta)


def _suspects(timed: dict[tuple[int, int, int], float]) -> list[tuple[int, int, int]]:
    """Grid points (batch, tokens, cache indices) timed slower than the same pass with more rows, more tokens or
    over a longer cache, which does more work. On a shared machine a timing is off only upwards (another process
    took the cores), so such a point is the likelier one to be wrong; where the longer block is cheaper for real
    (XLA's per-shape kernels), its second timing says so again and the figure stands."""
    return [key for key, x in timed.items()
            if any(x > timed.get(other, float("inf")) for other in ((key[0] + 1, key[1], key[2]),
                                                                  (key[0], key[1] + 1, key[2]),
                                                                  (key[0], key[1], key[2] + 1)))]


def head_model(layer: ModelConfig) -> Model:
    """A one-layer decoder of an EAGLE-3 head's layer config: what `profile_model` times for the head (the head's
    fusion and 2d-wide q/k/v add a few percent that the timing leaves out). Its params are shapes only, all a
    profile's lookup reads (`model_fingerprint`); `profile_model` draws random ones where it measures. Drawing
    them compiled Flax's init, about a second of every engine's first `generate` on a CPU."""
    layer = layer.replace(num_layers=1)
    return Model(layer, param_shapes(layer))


def _with_weights(model: Model) -> Model:
    """`model` with random params in place of shapes (`head_model`'s), to time its passes."""
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(model.params)):
        return model
    return model.with_params(init_params(model.config))


def load_or_profile(model: Model, *, measure: bool = False, grid: Grid = Grid(),
                    folder: str | Path | None = None, force: bool = False) -> CostTable | None:
    """The cached table of `model` on this device; with `measure`, profile and cache it when there is none;
    otherwise None. A file that cannot be read or whose fingerprint differs counts as none. `force` (with
    `measure`): profile again whatever is cached, and replace the file only once the new table is whole."""
    key = fingerprint(model, grid)
    path = profile_path(key, None if folder is None else Path(folder))
    cached = None if force and measure else _cached_table(path, key)  # --force: the file stays until replaced
    if cached is not None or not measure:
        return cached
    start = time.perf_counter()
    table = profile_model(model, grid)
    logger.info(f"profiled {model!r} in {time.perf_counter() - start:.1f} s -> {path}")
    atomic.write_json(path, {"fingerprint": key, "table": table.to_dict()})
    return table


def _cached_table(path: Path, key: dict[str, Any]) -> CostTable | None:
    """The table stored at `path` for fingerprint `key`; None for no file, a stale one or a corrupt one."""
    try:
        stored = json.loads(path.read_text())
        if stored.get("fingerprint") == key:
            return CostTable.from_dict(stored["table"])
        logger.debug(f"profile {path}: stale fingerprint, ignored")
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a corrupt file is no profile
        logger.warning(f"profile {path} ignored: {type(e).__name__}: {e}")
    return None


def pass_costs(target: Model, draft: Model | None = None, *, head=None, measure: bool = False,
               folder: str | Path | None = None, grid: Grid = Grid(),
               drafter_grid: Grid = DRAFTER_GRID) -> PassCosts:
    """The cost model of a generation with `target`, `draft` and an EAGLE-3 `head` (default: the one attached to the
    target, if any): each from its cached profile when there is one (or `measure`), else its roofline here."""
    def cost(model: Model, eagle3: bool = False):
        table = load_or_profile(model, measure=measure, grid=grid if model is target else drafter_grid,
                                folder=folder)
        return table if table is not None else roofline(model.config, eagle3=eagle3)

    head = head if head is not None else getattr(target, "eagle3", None)
    return PassCosts(target=cost(target), draft=None if draft is None else cost(draft),
                     eagle3=None if head is None else cost(head_model(head.config.layer), eagle3=True))
