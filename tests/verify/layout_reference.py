"""The host-side verification path, kept as the tests' reference (docs/design.md §2): the packed block in numpy
(`pack`, `pad_blocks`) and one target pass over host-packed blocks (`verify_pass`, and `sharded_verify_pass` under
`shard_map`). The library builds the same block on the device (`parse_jax.verify.block.pack_block`) and scores it
with `verify_block`; tests/verify/test_segment.py holds that code equal to this, and tests/parse_reference.py runs
the host-orchestrated PARSE on it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from parse_jax.distributed.mesh import mesh_shape
from parse_jax.distributed.sharded import ShardedModel, global_array, pad_cache
from parse_jax.errors import ConfigError, InputError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder
from parse_jax.models.sharding import cache_shardings, fitting_rules
from parse_jax.runtime.programs import forward_fn, register_program, to_host
from parse_jax.utils.validation import check_boundaries
from parse_jax.verify.block import PAD_GROUP
from parse_jax.verify.scoring import scores_from_logits


@dataclasses.dataclass(frozen=True)
class PackedBlock:
    """One request's verification block: draft then K suffix copies (docs/design.md §2). All int32 [T]."""

    tokens: np.ndarray
    positions: np.ndarray
    limit: np.ndarray
    group: np.ndarray
    score_index: np.ndarray  # [K]: the last token of each copy, where the judge words are read
    draft_len: int

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def pack(context_len: int, draft: Sequence[int], boundaries: Sequence[int], suffix: Sequence[int]) -> PackedBlock:
    """Draft token t: position C + t, sees the context and draft tokens <= t.
    Copy k token j: position C + b_k + j, sees the context, draft tokens < b_k and copy-k tokens <= j."""
    draft = np.asarray(draft, np.int32)
    d = int(draft.shape[0])
    b = check_boundaries(boundaries, d)
    suffix = np.asarray(suffix, np.int32)
    s = int(suffix.shape[0])
    if s < 1:
        raise InputError("the verification suffix is empty")
    if context_len < 0:
        raise InputError(f"context length must be >= 0, got {context_len}")
    k = len(b)
    bounds = np.asarray(b, np.int32)
    tokens = np.concatenate([draft, np.tile(suffix, k)])
    j = np.tile(np.arange(s, dtype=np.int32), k)
    positions = np.concatenate([context_len + np.arange(d, dtype=np.int32), context_len + np.repeat(bounds, s) + j])
    limit = np.concatenate([np.arange(1, d + 1, dtype=np.int32), np.repeat(bounds, s)])
    group = np.concatenate([np.zeros(d, np.int32), np.repeat(np.arange(1, k + 1, dtype=np.int32), s)])
    score_index = d + s * np.arange(1, k + 1, dtype=np.int32) - 1
    return PackedBlock(tokens.astype(np.int32), positions.astype(np.int32), limit, group, score_index, d)


def pad_blocks(blocks: Sequence[PackedBlock], length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Stack blocks into [B, length] arrays; padding is group PAD_GROUP / limit 0, invisible to every query."""
    if not blocks:
        raise InputError("no blocks to pad")
    longest = max(blk.length for blk in blocks)
    if length < longest:
        raise InputError(f"pad length {length} is shorter than the longest block ({longest} tokens)")
    b = len(blocks)
    out = {
        "tokens": np.full((b, length), pad_id, np.int32),
        "positions": np.zeros((b, length), np.int32),
        "limit": np.zeros((b, length), np.int32),
        "group": np.full((b, length), PAD_GROUP, np.int32),
    }
    for i, blk in enumerate(blocks):
        n = blk.length
        out["tokens"][i, :n] = blk.tokens
        out["positions"][i, :n] = blk.positions
        out["positions"][i, n:] = blk.positions[-1]
        out["limit"][i, :n] = blk.limit
        out["group"][i, :n] = blk.group
    return out


@dataclasses.dataclass
class VerifyOutput:
    scores: np.ndarray        # [B, K] judge score of each prefix (NaN for padded prefixes)
    boundary_logits: jax.Array  # [B, K + 1, V] next-token logits after each boundary; the last entry is at
    #                             `before_index` (e.g. the context's last token, for "nothing accepted")
    cache: KVCache            # block written, lengths unchanged: commit the accepted boundary
    tokens: np.ndarray | None = None     # [B, L] the padded block (with `taps`)
    features: jax.Array | None = None    # [B, L, len(taps) * d] the target's tapped hidden states (EAGLE-3)


@functools.cache
def verify_program(cfg: ModelConfig, attention_impl: str, taps: tuple[int, ...] = ()):
    module = Decoder(cfg, attention_impl)

    def run(params, cache, tokens, positions, limit, group, score_index, boundary_index, yes_id, no_id):
        logits, cache, hiddens = forward_fn(module, params, return_hidden=True)(tokens, positions, cache, limit,
                                                                                 group)
        at_scores = jnp.take_along_axis(logits, score_index[..., None], axis=1)
        scores = scores_from_logits(at_scores, yes_id, no_id)
        boundary_logits = jnp.take_along_axis(logits, boundary_index[..., None], axis=1)
        features = jnp.concatenate([hiddens[i] for i in taps], axis=-1) if taps else None
        return scores, boundary_logits, cache, features

    return register_program(jax.jit(run, donate_argnums=(1,)))


def check_blocks(cache: KVCache, blocks: Sequence[PackedBlock], length: int | None,
                 num_prefixes: int | None) -> tuple[int, int]:
    """The padded block length and prefix count of a verification pass, after checking that each row's block fits
    its cache row and has no more prefixes than that (clear errors instead of silently dropped slots)."""
    if len(blocks) != cache.batch:
        raise InputError(f"{len(blocks)} blocks for a cache of batch {cache.batch}")
    length = length or max(b.length for b in blocks)
    k_max = num_prefixes or max(len(b.score_index) for b in blocks)
    lengths = to_host(cache.lengths)
    for i, blk in enumerate(blocks):
        if lengths[i] + length > cache.max_len:
            raise InputError(f"row {i}: context of {lengths[i]} tokens plus a verification block of {length} "
                             f"does not fit the cache ({cache.max_len} slots)")
        if len(blk.score_index) > k_max:
            raise InputError(f"row {i} has {len(blk.score_index)} prefixes, more than num_prefixes={k_max}")
    return length, k_max


def verify_arrays(blocks: Sequence[PackedBlock], length: int, k_max: int,
                  before_index: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The host inputs of one verification pass: the padded blocks (`pad_blocks`), and per row the block index of
    each prefix's score (`score_index`), of the logits after each boundary (`boundary_index`: draft token b - 1
    predicts the token after a boundary b; copies sit at limit == b; the last column is `before_index`) and
    which prefixes are real (`valid`)."""
    arrays = pad_blocks(blocks, length)
    b = len(blocks)
    arrays["score_index"] = np.zeros((b, k_max), np.int32)
    arrays["boundary_index"] = np.zeros((b, k_max + 1), np.int32)
    if before_index is not None:
        arrays["boundary_index"][: len(before_index), k_max] = np.asarray(before_index, np.int32)
    arrays["valid"] = np.zeros((b, k_max), bool)
    for i, blk in enumerate(blocks):
        k = len(blk.score_index)
        arrays["score_index"][i, :k] = blk.score_index
        arrays["boundary_index"][i, :k] = blk.limit[blk.score_index] - 1
        arrays["valid"][i, :k] = True
    return arrays


def verify_pass(model, cache: KVCache, blocks: Sequence[PackedBlock], yes_id: int, no_id: int,
                length: int | None = None, num_prefixes: int | None = None,
                before_index: Sequence[int] | None = None, taps: Sequence[int] = ()) -> VerifyOutput:
    """One target pass over `cache` + each row's packed block (padded to `length`, K padded to
    `num_prefixes` so shapes stay in buckets). Row i of `blocks` belongs to cache row i.
    `before_index[i]` (block index, default 0) adds the logits of one more block token per row.
    `taps`: also return those hidden states (indices into the decoder's `hiddens`) of every block token."""
    length, k_max = check_blocks(cache, blocks, length, num_prefixes)
    arrays = verify_arrays(blocks, length, k_max, before_index)
    program = verify_program(model.config, model.attention_impl, tuple(int(t) for t in taps))
    scores, boundary_logits, cache, features = program(model.params, cache, arrays["tokens"], arrays["positions"],
                                                       arrays["limit"], arrays["group"], arrays["score_index"],
                                                       arrays["boundary_index"], np.int32(yes_id), np.int32(no_id))
    scores = np.where(arrays["valid"], to_host(scores), np.nan)
    return VerifyOutput(scores=scores, boundary_logits=boundary_logits, cache=cache,
                        tokens=arrays["tokens"] if taps else None, features=features)


@functools.cache
def _sharded_verify_program(cfg: ModelConfig, attention_impl: str, mesh: Mesh, taps: tuple[int, ...]):
    """`verify_program` under `shard_map` over `data`: each data shard runs it on its own rows; `model` stays
    automatic, so inside each shard the pass is tensor parallel over the params' `model` sharding (GSPMD)."""
    program = verify_program(cfg, attention_impl, taps)
    rows = P("data")
    fn = jax.shard_map(program, mesh=mesh, axis_names=frozenset({"data"}),
                       in_specs=(P(), rows, rows, rows, rows, rows, rows, rows, P(), P()),
                       out_specs=(rows, rows, rows, rows if taps else None))
    return register_program(jax.jit(fn, donate_argnums=(1,)))


def sharded_verify_pass(model, cache: KVCache, blocks: Sequence[PackedBlock], yes_id: int, no_id: int,
                        length: int | None = None, num_prefixes: int | None = None,
                        before_index: Sequence[int] | None = None, taps: Sequence[int] = (),
                        mesh: Mesh | None = None) -> VerifyOutput:
    """`verify_pass` with the batch of packed blocks spread over the mesh's `data` axis by `shard_map` (same
    arguments and result; `mesh` defaults to the model's). A batch that does not divide over `data` is padded with
    empty rows (a one-token block over an empty cache row) and the result unpadded."""
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
