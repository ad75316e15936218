"""Verification under `shard_map`: the batch of packed blocks spread over the mesh's `data` axis, each shard
running the verification program on its own rows; `model` stays automatic, so the pass is tensor parallel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parse_jax.distributed.args import add_distributed_args  # noqa: F401  (re-exported: the CLI flags)
from parse_jax.distributed.mesh import mesh_shape
from parse_jax.distributed.sharded import ShardedModel, global_array, pad_cache, shard_model
from parse_jax.errors import ConfigError, InputError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model
from parse_jax.models.sharding import cache_shardings, fitting_rules
from parse_jax.runtime.programs import bucket, register_program, to_host
from parse_jax.verify.layout import PackedBlock, check_boundaries, pack
from parse_jax.verify.scoring import VerifyOutput, check_blocks, verify_arrays, verify_program


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
    inputs = [global_array(arrays[name], rows) for name in
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
