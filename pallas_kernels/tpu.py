"""The TPU kernel (Pallas Mosaic): flash attention over the visited key blocks of each query block only.

Grid (batch, head, query block, step). The block map (`block_map.key_block_ranges`) is scalar-prefetched
into SMEM; the K/V index maps turn a step into the key block it visits, and past the last visited block they
keep returning that block, so the pipeline issues no DMA and the body (`pl.when`) does no compute: empty
(query block, key block) tiles cost one grid step each and nothing else. The mask is rebuilt inside the
kernel from iotas and the per-token metadata by `mask.visible` (the rule the reference uses); tiles the block
map marks full skip it. Online softmax in float32 scratch; a query with no visible key ends with l == 0 and
writes zeros.

On CPU the same kernel runs under the TPU interpreter (`interpret=pltpu.InterpretParams()`), which also
checks out-of-bounds reads and starts scratch buffers as NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.block_map import NUM_RANGES, key_block_ranges, key_groups_by_slot, round_up, visited_block
from pallas_kernels.mask import visible
from pallas_kernels.partition import out_struct

LANES, SUBLANES = 128, 8
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row never makes inf - inf


def _lanes(x: jax.Array, n: int) -> jax.Array:
    """A lane-replicated [rows, 128] array widened or narrowed to [rows, n] lanes."""
    return x[:, :n] if n <= LANES else jnp.tile(x, (1, n // LANES))


def _kernel(lengths_ref, ranges_ref, q_ref, k_ref, v_ref, qlimit_ref, qgroup_ref, kgroup_ref, *refs, scale: float,
            block_q: int, block_k: int, num_tokens: int, num_slots: int, num_q_blocks: int):
    o_ref, m_ref, l_ref, acc_ref = refs[-4:]  # refs[0] is the aliased poison buffer when there is one
    b, qi, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    base = (b * num_q_blocks + qi) * NUM_RANGES
    ranges = [ranges_ref[base + r] for r in range(NUM_RANGES)]
    kb, active = visited_block(ranges, step)
    head_dim = acc_ref.shape[-1]

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def tile(masked: bool):
        q, k = q_ref[...], k_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        mask = None
        if masked:
            shape = (block_q, block_k)
            row = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + qi * block_q
            slot = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + kb * block_k
            limit = jnp.tile(qlimit_ref[...], (1, block_k // LANES))
            group = jnp.tile(qgroup_ref[...], (1, block_k // LANES))
            kgroup = kgroup_ref[:1, :]
            mask = visible(slot, lengths_ref[b], kgroup, group, row, limit, num_tokens, num_slots)
            s = jnp.where(mask, s, MASK_VALUE)
        m_prev, l_prev = m_ref[...], l_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [block_q, 128]
        p = jnp.exp(s - _lanes(m_next, block_k))
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * _lanes(alpha, head_dim) + pv

    @pl.when(active & (kb < ranges[0]))
    def _full():
        tile(masked=False)

    @pl.when(active & (kb >= ranges[0]))
    def _partial():
        tile(masked=True)

    @pl.when(step == pl.num_programs(3) - 1)
    def _write():
        denom = _lanes(l_ref[...], head_dim)
        o_ref[...] = (acc_ref[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def check_blocks(block_q: int, block_k: int, compiled: bool) -> None:
    if block_q <= 0 or block_k <= 0 or block_q % SUBLANES or block_k % LANES:
        raise ValueError(f"TPU blocks need block_q % {SUBLANES} == 0 and block_k % {LANES} == 0, "
                         f"got block_q={block_q}, block_k={block_k}")
    if compiled and block_q % LANES:
        raise ValueError(f"compiled TPU blocks must be multiples of {LANES}, got block_q={block_q} "
                         "(smaller query blocks are for interpret-mode tests)")


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret"))
def attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, limit: jax.Array, group: jax.Array,
                  scale: float | None = None, block_q: int = 128, block_k: int = 128, interpret: bool = False,
                  poison: jax.Array | None = None) -> jax.Array:
    """Same contract as `attention_reference`. `interpret` runs the TPU interpreter (on any backend).

    `poison` ([B, T_pad, H, D] in q's dtype, T_pad = T rounded up to block_q), when given, is the output buffer
    (aliased): tests fill it with NaN to prove every output element is written.
    """
    check_blocks(block_q, block_k, compiled=not interpret)
    b, t, h, d = q.shape
    kv_heads, s_len = k.shape[1], k.shape[2]
    groups = h // kv_heads
    scale = d ** -0.5 if scale is None else scale
    d_real, d = d, (d if d <= LANES else round_up(d, LANES))  # wide heads: whole lane tiles, zero-padded
    pad_d = (0, d - d_real)
    t_pad, s_pad = round_up(t, block_q), round_up(s_len, block_k)
    nq, nk = t_pad // block_q, s_pad // block_k

    ranges = key_block_ranges(lengths, limit, group, s_len, block_q, block_k).reshape(-1)
    lengths = lengths.astype(jnp.int32)
    qt = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), pad_d)).transpose(0, 2, 1, 3)  # [B, H, T_pad, D]
    kt = jnp.pad(k, ((0, 0), (0, 0), (0, s_pad - s_len), pad_d))  # [B, KV, S_pad, D]
    vt = jnp.pad(v, ((0, 0), (0, 0), (0, s_pad - s_len), pad_d))
    pad_t = ((0, 0), (0, t_pad - t))
    qlimit = jnp.broadcast_to(jnp.pad(limit.astype(jnp.int32), pad_t)[:, :, None], (b, t_pad, LANES))
    qgroup = jnp.broadcast_to(jnp.pad(group.astype(jnp.int32), pad_t)[:, :, None], (b, t_pad, LANES))
    kgroup = jnp.broadcast_to(key_groups_by_slot(lengths, group, s_pad)[:, None, :], (b, SUBLANES, s_pad))
    def kv_map(bi, hi, qi, step, lengths_ref, ranges_ref):
        base = (bi * nq + qi) * NUM_RANGES
        kb, _ = visited_block([ranges_ref[base + r] for r in range(NUM_RANGES)], step)
        return bi, hi // groups, kb, 0

    def kgroup_map(bi, hi, qi, step, lengths_ref, ranges_ref):
        _, _, kb, _ = kv_map(bi, hi, qi, step, lengths_ref, ranges_ref)
        return bi, 0, kb

    q_spec = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, qi, step, *_: (bi, hi, qi, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, d), kv_map)
    qmeta_spec = pl.BlockSpec((None, block_q, LANES), lambda bi, hi, qi, step, *_: (bi, qi, 0))
    kmeta_spec = pl.BlockSpec((None, SUBLANES, block_k), kgroup_map)
    args = [lengths, ranges, qt, kt, vt, qlimit, qgroup, kgroup]
    in_specs = [q_spec, kv_spec, kv_spec, qmeta_spec, qmeta_spec, kmeta_spec]
    aliases = {}
    if poison is not None:
        aliases = {len(args): 0}
        args.append(jnp.pad(poison, ((0, 0), (0, 0), (0, 0), pad_d)).transpose(0, 2, 1, 3))
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    kernel = functools.partial(_kernel, scale=float(scale), block_q=block_q, block_k=block_k, num_tokens=t,
                               num_slots=s_len, num_q_blocks=nq)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, h, nq, nk),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((block_q, LANES), jnp.float32), pltpu.VMEM((block_q, LANES), jnp.float32),
                            pltpu.VMEM((block_q, d), jnp.float32)],
        ),
        out_shape=out_struct((b, h, t_pad, d), q.dtype, q, k, v, lengths, limit, group),
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="multi_prefix_attention_tpu",
    )(*args)
    return out.transpose(0, 2, 1, 3)[:, :t, :, :d_real]
