"""Prefix scoring under `shard_map`: the batch of requests spread over the mesh's `data` axis, each shard packing
and scoring its own rows with the single-device pass (`scoring.prefix_scores_fn`: `block.pack_block` +
`verify_block`, the code the modes run); `model` stays automatic, so the pass is tensor parallel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parse_jax.distributed.mesh import mesh_shape
from parse_jax.distributed.sharded import global_array, shard_model
from parse_jax.errors import ConfigError, InputError
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model
from parse_jax.runtime.programs import register_program, to_host
from parse_jax.utils.validation import check_boundaries
from parse_jax.verify.scoring import prefix_rows, prefix_scores_fn


@functools.cache
def sharded_prefix_scores_program(cfg: ModelConfig, attention_impl: str, mesh: Mesh):
    """`scoring.prefix_scores_fn` under `shard_map` over `data`: each data shard packs and scores its own rows.
    Only `data` is manual; `model` stays automatic, so inside each shard the pass is tensor parallel over the
    params' `model` sharding (GSPMD), in the same program."""
    rows = P("data")
    fn = jax.shard_map(prefix_scores_fn(cfg, attention_impl), mesh=mesh, axis_names=frozenset({"data"}),
                       in_specs=(P(), rows, rows, rows, rows, P(), P(), P()), out_specs=rows)
    return register_program(jax.jit(fn))


def sharded_score_prefixes(model: Model, seqs: Sequence[Sequence[int]], ends: Sequence[Sequence[int]], *,
                           suffix: Sequence[int], yes_id: int, no_id: int, mesh: Mesh) -> list[np.ndarray]:
    """`scoring.score_prefixes` with the requests spread over the mesh's `data` axis (same arguments and result).
    A batch that does not divide over `data` is padded with one-token requests, their scores dropped."""
    data = mesh_shape(mesh)[0]
    arrays = prefix_rows(seqs, ends, len(suffix), rows=-(-len(seqs) // data) * data)
    rows = NamedSharding(mesh, P("data"))
    inputs = [global_array(arrays[name], rows) for name in ("seq", "seq_len", "ends", "count")]
    program = sharded_prefix_scores_program(model.config, model.attention_impl, mesh)
    scores = to_host(program(model.params, *inputs, np.asarray(suffix, np.int32), np.int32(yes_id),
                             np.int32(no_id)))
    return [scores[i, : len(e)].astype(np.float64) for i, e in enumerate(ends)]


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
    seqs, ends = [], []
    for ctx, draft, bounds in zip(contexts, drafts, boundaries, strict=True):
        ctx, draft = engine._ids("context_ids", ctx), engine._ids("draft_ids", draft)
        bounds = check_boundaries(bounds, len(draft))
        engine.check_block_positions(len(ctx), len(draft))
        seqs.append(ctx + draft)
        ends.append([len(ctx) + b for b in bounds])
    return sharded_score_prefixes(target, seqs, ends, suffix=engine.suffix_ids, yes_id=engine.yes_id,
                                  no_id=engine.no_id, mesh=mesh)
