"""The kernels on a device mesh: XLA cannot partition a Mosaic or Triton custom call, so on a mesh of more than one
device a compiled kernel runs under `jax.shard_map`, each device on its own rows and heads.

The mesh is the one programs are traced under (`jax.sharding.get_abstract_mesh()`: `jax.set_mesh(mesh)`, or
`use_abstract_mesh` when lowering for a mesh that exists nowhere). Rows split over `ROW_AXIS` and query/key-value
heads over `HEAD_AXIS` (parse_jax's `data` and `model` axes) where they divide; an axis that divides nothing is
replicated (every device of it computes the same slice). Axes already manual (inside an enclosing `shard_map`) are
left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

ROW_AXIS, HEAD_AXIS = "data", "model"


def out_struct(shape: tuple[int, ...], dtype, *inputs: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel's output shape that varies over the manual mesh axes its inputs vary over (what `pallas_call`
    needs inside a `shard_map`)."""
    kinds = [jax.typeof(x).manual_axis_type for x in inputs]
    kinds = [k for k in kinds if k is not None]
    if not kinds:
        return jax.ShapeDtypeStruct(shape, dtype)
    varying = frozenset().union(*(k.varying for k in kinds))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=kinds[0].__class__(varying=varying))


def free_axes() -> dict[str, int]:
    """Axis name -> size of the traced-under mesh's axes that are not manual yet (empty off a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return {}
    return {n: int(s) for n, s, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True)
            if t != AxisType.Manual}


def needs_partition() -> bool:
    """Whether a compiled kernel must run under `shard_map` here (a mesh of more than one device, not all manual)."""
    sizes = free_axes()
    return any(s > 1 for s in sizes.values())


def partitioned(kernel: Callable, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, limit: jax.Array,
                group: jax.Array, *, check_vma: bool = True) -> jax.Array:
    """`kernel(q, k, v, lengths, limit, group)` (q [B, T, H, D], k/v [B, KV, S, D]) under `shard_map` over the free
    axes of the traced-under mesh (see the module doc). `check_vma=False` for an interpreted kernel: jax's Pallas
    interpreter indexes blocks with a grid counter that varies over no mesh axis, which shard_map's varying-axes
    check refuses (jax 0.10: "dynamic_slice requires varying manual axes to match")."""
    sizes = free_axes()
    rows = ROW_AXIS if sizes.get(ROW_AXIS, 1) > 1 and q.shape[0] % sizes[ROW_AXIS] == 0 else None
    m = sizes.get(HEAD_AXIS, 1)
    heads = HEAD_AXIS if m > 1 and q.shape[2] % m == 0 and k.shape[1] % m == 0 else None
    q_spec, kv_spec, row_spec = P(rows, None, heads, None), P(rows, heads, None, None), P(rows, None)
    mesh = jax.sharding.get_abstract_mesh()
    fn = jax.shard_map(kernel, mesh=mesh, axis_names=frozenset(sizes), check_vma=check_vma,
                       in_specs=(q_spec, kv_spec, kv_spec, P(rows), row_spec, row_spec), out_specs=q_spec)
    return fn(q, k, v, lengths, limit, group)
