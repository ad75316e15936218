"""The programs a run of each mode would compile, with abstract arguments: nothing is allocated or run.

`abstract_context(ctx, ...)` swaps the models of an engine's `ModeContext` for `AbstractModel`s: the same configs,
tokenizers and settings, params as `jax.ShapeDtypeStruct`s (carrying their `NamedSharding`s over an abstract mesh
when one is given), so an 8B pair is planned on a laptop. `mode_launches(ctx, mode, req)` then asks each mode's own
launch helper for its programs and arguments (the code a run calls), every bucket the request would meet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parse_jax.distributed.verify import sharded_prefix_scores_program
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model, param_shapes
from parse_jax.models.sharding import abstract_params, fitting_rules
from parse_jax.modes.context import ModeContext
from parse_jax.modes.parse import (
    ContinueSpec,
    continue_single,
    eagle_spec,
    multi_launch,
    runs_fused,
    single_launch,
    stage_program,
    staged_launch,
)
from parse_jax.modes.sequential import sequential_launch
from parse_jax.runtime.decode import generate_launch
from parse_jax.runtime.programs import bucket
from parse_jax.runtime.requests import Request
from parse_jax.speculation.draft_model import spec_args, speculate_launch
from parse_jax.speculation.eagle3 import eagle3_launch
from parse_jax.verify.scoring import prefix_rows, prefix_scores_program

LOWERED_MODES = ("target", "sd", "sequential", "parse", "parse-single", "parse-multi", "eagle3", "parse+eagle3",
                 "prefix_scores")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One program of a run: a name for the report, the jitted function and its (abstract) arguments."""

    name: str
    program: Any
    args: tuple


class AbstractModel(Model):
    """A `Model` whose params are `ShapeDtypeStruct`s (on an abstract mesh when `mesh` is set): what lowering and
    memory planning read. Its rows are placed over `data` like a sharded model's."""

    def __init__(self, config: ModelConfig, tokenizer: Any, attention_impl: str, mesh: AbstractMesh | None,
                 fallback_replicated: bool = False) -> None:
        if mesh is None:
            params = param_shapes(config)
        else:
            params = abstract_params(config, mesh, fitting_rules(config, mesh, fallback_replicated))
        super().__init__(config, params, tokenizer, attention_impl)
        self.mesh = mesh

    def place_rows(self, x: np.ndarray) -> jax.ShapeDtypeStruct:
        x = np.asarray(x)
        sharding = None
        if self.mesh is not None:
            axis = "data" if x.shape[0] % int(self.mesh.shape["data"]) == 0 else None
            sharding = NamedSharding(self.mesh, P(axis))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_tree(tree: Any, mesh: AbstractMesh | None = None) -> Any:
    """Every array of `tree` as a `ShapeDtypeStruct` (replicated over `mesh` when it has no sharding yet)."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x_shape, dtype = np.shape(x), (x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        sharding = NamedSharding(mesh, P()) if mesh is not None else None
        return jax.ShapeDtypeStruct(x_shape, dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def abstract_context(ctx: ModeContext, *, attention_impl: str, mesh: AbstractMesh | None) -> ModeContext:
    """`ctx` with abstract models (see the module doc); the draft falls back to replicated params on a mesh it does
    not divide, as `ParseEngine(mesh=...)` places it."""
    target = AbstractModel(ctx.target.config, ctx.target.tokenizer, attention_impl, mesh)
    draft = None
    if ctx.draft is not None:
        draft = AbstractModel(ctx.draft.config, ctx.draft.tokenizer, attention_impl, mesh, fallback_replicated=True)
    head = ctx.head
    if head is not None:
        head = dataclasses.replace(head, params=abstract_tree(head.params, mesh))
    return dataclasses.replace(ctx, target=target, draft=draft, head=head, judge=abstract_tree(ctx.judge, mesh))


def _with_rows(tree: Any, rows: int) -> Any:
    """Shapes of `tree` (abstract) with `rows` leading rows: what `take_rows` hands the continuation."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), tree)


def _single(ctx: ModeContext, req: Request, eagle: bool, label: str) -> list[Launch]:
    """A single round: the fused program, or the staged one (its draft, its pass over the longest block bucket: the
    largest of the passes it sets up one by one) and its continuation at every row bucket it may take."""
    b = bucket(len(req.ids), 1)
    if runs_fused(ctx, req):
        launch = single_launch(ctx, req, eagle)
        return [Launch(f"{label}.round", launch.program, launch.args)]
    launch = staged_launch(ctx, req, eagle)
    shape, staged = launch.shape, launch.staged
    draft, verify = stage_program(staged.draft), stage_program(staged.verifier(staged.lengths[-1]))
    pass_args = launch.pass_args(jax.eval_shape(draft.jitted, *abstract_tree(launch.draft_args))[0])
    out = [Launch(f"{label}.draft", draft, launch.draft_args), Launch(f"{label}.round", verify, pass_args)]
    state = jax.eval_shape(verify.jitted, *abstract_tree(pass_args))
    spec = ContinueSpec(ctx.target.config, ctx.target.attention_impl, shape.num_new, req.sampling.sampler,
                        eagle_spec(ctx) if eagle else None)
    rows = 1
    while rows <= b:
        cache, context = _with_rows((state["cache"], state["context"]), rows)
        args = (ctx.target.params, ctx.head.params if eagle else None, cache, context, np.zeros(rows, np.int32),
                req.eos, req.sampling.args(rows))
        out.append(Launch(f"{label}.continue.rows{rows}", continue_single(spec), args))
        rows *= 2
    return out


def _prefix_scores(ctx: ModeContext, req: Request) -> list[Launch]:
    """The prefix-scoring pass (`ParseEngine.prefix_scores`): each row a prompt-long context, a draft of the budget
    and max_prefixes evenly spaced boundaries (over `data` by `shard_map` on a mesh)."""
    k = max(1, min(ctx.config.max_prefixes, req.max_new))
    seqs, ends = [], []
    for ids in req.ids:
        seqs.append(ids + [ids[-1]] * req.max_new)
        ends.append([len(ids) + (req.max_new * (i + 1)) // k for i in range(k)])
    target = ctx.target
    mesh = target.mesh
    data = 1 if mesh is None else int(mesh.shape["data"])
    arrays = prefix_rows(seqs, ends, len(ctx.suffix_ids), rows=-(-len(seqs) // data) * data)
    rows = [target.place_rows(arrays[n]) for n in ("seq", "seq_len", "ends", "count")]
    tail = (np.asarray(ctx.suffix_ids, np.int32), np.int32(0), np.int32(1))
    if mesh is None:
        program = prefix_scores_program(target.config, target.attention_impl)
    else:
        program = sharded_prefix_scores_program(target.config, target.attention_impl, mesh)
    return [Launch("prefix_scores", program, (target.params, *rows, *tail))]


def mode_launches(ctx: ModeContext, mode: str, req: Request) -> list[Launch]:
    """Every program a run of `mode` over `req` compiles, with its arguments (`ctx` from `abstract_context`).
    "parse-single" / "parse-multi" are mode parse with that `rounds` (`ctx.config` says it already)."""
    target, draft = ctx.target, ctx.draft
    cfg = ctx.config
    if mode == "target":
        program, args = generate_launch(target, req.ids, req.max_new, req.sampling, req.eos,
                                        target.config.max_position_embeddings)
        return [Launch("target.generate", program, args)]
    if mode == "sd":
        program, sb = speculate_launch(target, draft, req, gamma=cfg.speculation.gamma)
        return [Launch("sd.speculate", program, spec_args(target, draft.params, sb))]
    if mode == "eagle3":
        program, sb = eagle3_launch(target, ctx.head, req, cfg.eagle3)
        return [Launch("eagle3.speculate", program, spec_args(target, ctx.head.params, sb))]
    if mode == "sequential":
        program, args = sequential_launch(ctx, req)
        return [Launch("sequential.rounds", program, args)]
    if mode == "prefix_scores":
        return _prefix_scores(ctx, req)
    eagle = mode == "parse+eagle3"
    if cfg.rounds == "multi":
        launch = multi_launch(ctx, req, eagle=eagle)
        return [Launch(f"{'parse+eagle3' if eagle else 'parse'}-multi.rounds", launch.program, launch.args)]
    return _single(ctx, req, eagle, "parse+eagle3" if eagle else "parse-single")
