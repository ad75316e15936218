"""The GPU kernel (Pallas, Triton lowering): flash attention whose key loops run over the visited blocks only.

Grid (query block, batch, head), as in jax's `pallas/ops/gpu/attention.py`. Each program reads its row of the
block map (`block_map.key_block_ranges`) and runs three loops: key blocks [0, full_end) without a mask
(fully visible), [full_end, a_end) and [b_start, b_end) with the mask rebuilt from iotas and the per-token
metadata by `mask.visible` (the rule the reference uses). Key blocks outside these bounds are never loaded.
Online softmax in float32 registers; a query with no visible key ends with l == 0 and writes zeros.

On CPU it runs with `interpret=True` (the generic Pallas interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.block_map import key_block_ranges, key_groups_by_slot, round_up
from pallas_kernels.mask import visible
from pallas_kernels.partition import out_struct

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row never makes inf - inf
META = 8  # per query block: lengths, full_end, a_end, b_start, b_end, 3 unused (a power of two for Triton)


def _kernel(meta_ref, q_ref, k_ref, v_ref, qlimit_ref, qgroup_ref, kgroup_ref, *refs, scale: float, block_q: int,
            block_k: int, num_tokens: int, num_slots: int):
    o_ref = refs[-1]  # refs[0] is the aliased poison buffer when there is one
    qi = pl.program_id(0)
    ctx, full_end, a_end, b_start, b_end = (meta_ref[r] for r in range(5))
    q = q_ref[...]
    head_dim = q.shape[-1]
    limit = qlimit_ref[...][:, None]
    group = qgroup_ref[...][:, None]
    row = (qi * block_q + jnp.arange(block_q, dtype=jnp.int32))[:, None]

    def body(kb, carry, masked: bool):
        acc, m_prev, l_prev = carry
        keys = pl.ds(kb * block_k, block_k)
        k = k_ref[keys, :]
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * scale  # float32 [block_q, block_k]
        if masked:
            slot = (kb * block_k + jnp.arange(block_k, dtype=jnp.int32))[None, :]
            kgroup = kgroup_ref[keys][None, :]
            mask = visible(slot, ctx, kgroup, group, row, limit, num_tokens, num_slots)
            s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.exp(s - m_next[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        v = v_ref[keys, :]
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
        return acc, m_next, l_prev * alpha + jnp.sum(p, axis=1)

    carry = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = jax.lax.fori_loop(0, full_end, functools.partial(body, masked=False), carry)
    carry = jax.lax.fori_loop(full_end, a_end, functools.partial(body, masked=True), carry)
    acc, _, denom = jax.lax.fori_loop(b_start, b_end, functools.partial(body, masked=True), carry)
    o_ref[...] = (acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]).astype(o_ref.dtype)


def gpu_block_q(t: int, block_q: int) -> int:
    """Short blocks (decode, small verifications) use a smaller query tile: at least 16 rows for tensor cores."""
    return min(block_q, max(16, pl.next_power_of_2(t)))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps", "num_stages", "interpret"))
def attention_gpu(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, limit: jax.Array, group: jax.Array,
                  scale: float | None = None, block_q: int = 64, block_k: int = 64, num_warps: int | None = None,
                  num_stages: int = 2, interpret: bool = False, poison: jax.Array | None = None) -> jax.Array:
    """Same contract as `attention_reference`. `interpret=True` runs the Pallas interpreter (on any backend).

    `poison` ([B, T_pad, H, D] in q's dtype, T_pad = T rounded up to the query block `gpu_block_q(T, block_q)`),
    when given, is the output buffer (aliased): tests fill it with NaN to prove every element is written.
    A head_dim that is not a power of two >= 16 is zero-padded to one (the scores do not change).
    """
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"GPU {name} must be a power of two >= 16, got {size}")
    b, t, h, d = q.shape
    kv_heads, s_len = k.shape[1], k.shape[2]
    groups = h // kv_heads
    scale = d ** -0.5 if scale is None else scale
    d_real, d = d, max(16, pl.next_power_of_2(d))  # Triton dots want power-of-two sizes >= 16: pad with zeros
    block_q = gpu_block_q(t, block_q)
    t_pad, s_pad = round_up(t, block_q), round_up(s_len, block_k)
    nq = t_pad // block_q

    ranges = key_block_ranges(lengths, limit, group, s_len, block_q, block_k)  # [B, nq, 4]
    lengths = lengths.astype(jnp.int32)
    meta = jnp.concatenate([jnp.broadcast_to(lengths[:, None, None], (b, nq, 1)), ranges,
                            jnp.zeros((b, nq, META - 5), jnp.int32)], axis=2)
    pad_t = ((0, 0), (0, t_pad - t))
    pad_d = (0, d - d_real)
    qp = jnp.pad(q, (*pad_t, (0, 0), pad_d))
    kp = jnp.pad(k, ((0, 0), (0, 0), (0, s_pad - s_len), pad_d))
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, s_pad - s_len), pad_d))
    qlimit = jnp.pad(limit.astype(jnp.int32), pad_t)
    qgroup = jnp.pad(group.astype(jnp.int32), pad_t)
    kgroup = key_groups_by_slot(lengths, group, s_pad)

    q_spec = pl.BlockSpec((None, block_q, None, d), lambda qi, bi, hi: (bi, qi, hi, 0))
    kv_spec = pl.BlockSpec((None, None, s_pad, d), lambda qi, bi, hi: (bi, hi // groups, 0, 0))
    args = [meta, qp, kp, vp, qlimit, qgroup, kgroup]
    in_specs = [pl.BlockSpec((None, None, META), lambda qi, bi, hi: (bi, qi, 0)), q_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, block_q), lambda qi, bi, hi: (bi, qi)),
                pl.BlockSpec((None, block_q), lambda qi, bi, hi: (bi, qi)),
                pl.BlockSpec((None, s_pad), lambda qi, bi, hi: (bi, 0))]
    aliases = {}
    if poison is not None:
        aliases = {len(args): 0}
        args.append(jnp.pad(poison, ((0, 0), (0, 0), (0, 0), pad_d)))
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    kernel = functools.partial(_kernel, scale=float(scale), block_q=block_q, block_k=block_k, num_tokens=t,
                               num_slots=s_len)
    out = pl.pallas_call(
        kernel,
        grid=(nq, b, h),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=out_struct((b, t_pad, h, d), q.dtype, q, k, v, lengths, limit, group),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or (4 if d <= 64 else 8), num_stages=num_stages),
        interpret=interpret,
        name="multi_prefix_attention_gpu",
    )(*args)
    return out[:, :t, :, :d_real]
