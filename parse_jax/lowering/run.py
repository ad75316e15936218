"""`lower_run`: every program a run of one mode would compile, lowered for a TPU or a GPU chip, with the run's
memory plan: what `ParseEngine.lower` and `parse-jax lower` return and write.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from parse_jax.distributed.mesh import parse_mesh_spec
from parse_jax.errors import ConfigError, InputError
from parse_jax.lowering.chips import Chip, chip
from parse_jax.lowering.export import LoweredProgram, lower_launch, target_context
from parse_jax.lowering.launches import LOWERED_MODES, abstract_context, mode_launches
from parse_jax.lowering.memory import MemoryPlan, plan_memory
from parse_jax.utils.validation import check_choice, check_int


@dataclasses.dataclass(frozen=True)
class LoweredRun:
    """The programs of one run, lowered for `chip` on a mesh of `mesh` chips, and its memory plan."""

    mode: str
    chip: Chip
    mesh: dict[str, int]
    batch_size: int
    prompt_len: int
    max_new_tokens: int
    programs: tuple[LoweredProgram, ...]
    memory: MemoryPlan
    seconds: float

    @property
    def exported(self) -> dict[str, Any]:
        """Program name -> its `jax.export.Exported` (the programs that lowered)."""
        return {p.name: p.exported for p in self.programs if p.ok}

    @property
    def failed(self) -> dict[str, str]:
        """Program name -> why it could not be lowered."""
        return {p.name: p.error for p in self.programs if not p.ok}

    def report(self) -> dict[str, Any]:
        return {"mode": self.mode, "platform": self.chip.platform, "chip": self.chip.name,
                "device_kind": self.chip.device_kind, "mesh": self.mesh, "batch_size": self.batch_size,
                "prompt_len": self.prompt_len, "max_new_tokens": self.max_new_tokens,
                "lowering_seconds": round(self.seconds, 2), "programs": [p.summary() for p in self.programs],
                "memory": self.memory.as_dict()}


def _mesh_sizes(mesh: Any) -> dict[str, int]:
    sizes = parse_mesh_spec(mesh) if mesh is not None else {"data": 1, "model": 1}
    if -1 in sizes.values():
        raise ConfigError(f"a mesh to lower for names every axis size (e.g. data=2,model=4), got {sizes}")
    return sizes


@dataclasses.dataclass(frozen=True)
class LowerTarget:
    """What to lower for: `platform`'s chip `chip` (None: the platform's default; a platform of None: the chip's,
    or tpu), over a (data, model) `mesh` of such chips ("data=2,model=4", a mapping, or None: one chip), with
    `attention_impl` ("pallas": the platform's kernel)."""

    platform: str | None = None
    chip: str | None = None
    mesh: Any = None
    attention_impl: str = "pallas"


def lower_run(engine, mode: str, batch_size: int, max_new_tokens: int, *, target: LowerTarget = LowerTarget(),
              prompt_len: int = 64, lower: bool = True) -> LoweredRun:
    """Lower the programs `engine.generate([prompt] * batch_size, mode, max_new_tokens)` would compile (prompts of
    `prompt_len` tokens) for `target`. Mode "prefix_scores" lowers `engine.prefix_scores`'s pass (contexts of
    `prompt_len`, drafts of `max_new_tokens`); "parse-single" / "parse-multi" are mode parse with that `rounds`.
    `lower=False`: the memory plan alone (no program traced)."""
    check_choice("mode", mode, LOWERED_MODES, error=InputError)
    batch_size = check_int("batch_size", batch_size, 1, error=InputError)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1, error=InputError)  # one budget: what lowers
    prompt_len = check_int("prompt_len", prompt_len, 1, error=InputError)
    sizes = _mesh_sizes(target.mesh)
    device = chip(target.chip, target.platform)
    run_mode = "parse" if mode in ("parse-multi", "parse-single", "prefix_scores") else mode
    ids = [[_filler(engine)] * prompt_len for _ in range(batch_size)]
    if mode == "prefix_scores":
        engine.check_block_positions(prompt_len, max_new_tokens)
        req = engine.request(ids, "target", max_new_tokens, 0.0, 0, 0, 1.0, None)
    else:
        req = engine.request(ids, run_mode, max_new_tokens, 0.0, 0, 0, 1.0, None)
    t0 = time.perf_counter()
    with target_context(device, sizes) as abstract:
        ctx = abstract_context(engine.context, attention_impl=target.attention_impl,
                               mesh=abstract if abstract.size > 1 else None)
        if mode in ("parse-multi", "parse-single"):
            ctx = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, rounds=mode.split("-")[1]))
            rounds: tuple[str | None, ...] = (None,)
        else:  # what `generate` may run: under schedule="auto" over rounds="auto", multi and single round both
            rounds = (engine._rounds_options(run_mode, req, batch_size)
                      if engine.config.schedule == "auto" and mode != "prefix_scores" else (None,))
        taken = [ctx if r is None else dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, rounds=r))
                 for r in rounds]  # each rounds' programs have names of their own
        launches = [launch for c in (taken if lower else ()) for launch in mode_launches(c, mode, req)]
        programs = tuple(lower_launch(launch, device, abstract) for launch in launches)
    plan = plan_memory(ctx, mode, req, device, sizes, rounds=rounds)  # no `batch`: "batch b" offered is b prompts
    return LoweredRun(mode, device, sizes, batch_size, prompt_len, req.max_new, programs, plan,
                      time.perf_counter() - t0)


def _filler(engine) -> int:
    """A token every prompt may hold: the tokenizer's BOS, else id 1 (shapes are all lowering reads)."""
    bos = getattr(engine.target.tokenizer, "bos_id", None)
    return int(bos) if bos is not None else 1


def check_memory(engine, prompts, mode: str, max_new_tokens: int, device: Any = None):
    """Refuse, before anything is allocated, a run of `engine.generate(prompts, mode, max_new_tokens)` whose weights,
    caches and largest pass do not fit the device (default: the first one): a ConfigError of one line naming the
    sizes and what would fit. Returns the plan (None on a device that reports no capacity: a CPU).
    `engine.generate` makes this check itself (`engine.memory_guard`)."""
    from parse_jax.lowering.memory import MemoryGuard

    req = engine.request(prompts, mode, max_new_tokens, 0.0, 0, 0, 1.0, None)
    return MemoryGuard(device).check(engine.context, mode, req)
