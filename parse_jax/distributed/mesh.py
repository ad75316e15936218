"""The (data, model) device mesh: `make_mesh` from a spec (`data=2,model=4`, a mapping or a YAML file).

Requests are split over `data`; tensors (attention heads, MLP hidden, vocab) over `model`, the mesh's inner axis,
so it maps to the closest devices (one host, ICI).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from parse_jax.errors import ConfigError

AXES = ("data", "model")



def parse_mesh_spec(spec: str | Mapping[str, int] | Path | None, name: str = "mesh spec") -> dict[str, int]:
    """`{"data": 2, "model": 4}`, `"data=2,model=4"`, or a YAML file holding such a mapping (top level or under
    `mesh:`) -> axis sizes. A missing axis is 1; one axis may be -1 (all remaining devices). A string naming no axis
    ("", ",") is an error, never a silent one-device mesh; `name`: what that error calls the spec (e.g. --mesh)."""
    from parse_jax.utils.validation import check_int

    if spec is None:
        return {"data": -1, "model": 1}
    where = "mesh spec"
    if isinstance(spec, Path) or (isinstance(spec, str) and spec.endswith((".yaml", ".yml"))):
        import yaml

        path = Path(spec)
        where = f"mesh config file {path}"
        if not path.is_file():
            raise ConfigError(f"mesh config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"{path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read mesh config file {path}: {e}") from None
        spec = loaded.get("mesh", loaded) if isinstance(loaded, dict) else loaded
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{path} must hold a mapping like `mesh: {{data: 2, model: 4}}`")
    if isinstance(spec, str):
        pairs: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            axis, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"mesh spec {spec!r}: expected `axis=size` pairs like data=2,model=4")
            if axis.strip() in pairs:
                raise ConfigError(f"mesh spec {spec!r}: axis {axis.strip()!r} given twice")
            pairs[axis.strip()] = value.strip()
        if not pairs:
            raise ConfigError(f"{name} {spec!r} names no mesh axis: give axis=size pairs over {', '.join(AXES)} like "
                              "data=2,model=4, or a YAML file holding `mesh: {data: 2, model: 4}`")
        spec = pairs
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a mesh is a mapping of axis sizes like {{'data': 2, 'model': 4}}, got {spec!r}")
    unknown = sorted(str(k) for k in set(spec) - set(AXES))
    if unknown:
        raise ConfigError(f"{where}: unknown mesh axes {unknown}; the mesh axes are {list(AXES)}")
    sizes = {}
    for axis in AXES:
        value = spec.get(axis, 1)
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"{where}: mesh axis {axis} must be an integer, got {value!r}") from None
        size = check_int(f"{where}: mesh axis {axis}", value)
        if size == 0 or size < -1:
            raise ConfigError(f"{where}: mesh axis {axis} must be >= 1 (or -1: all remaining devices), got {size}")
        sizes[axis] = size
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError("at most one mesh axis may be -1")
    return sizes



def make_mesh(spec: str | Mapping[str, int] | Path | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: every device of every process). Its size must equal
    the device count: a mesh that leaves devices idle, or needs more than exist, is a configuration error."""
    sizes = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if -1 in sizes.values():
        fixed = int(np.prod([s for s in sizes.values() if s != -1]))
        if n % fixed:
            raise ConfigError(f"mesh {sizes}: {n} devices are not a multiple of the fixed axes' product {fixed}")
        sizes = {k: (n // fixed if v == -1 else v) for k, v in sizes.items()}
    total = sizes["data"] * sizes["model"]
    if total != n:
        raise ConfigError(f"mesh data={sizes['data']} x model={sizes['model']} = {total} devices, but {n} "
                          f"device(s) are available ({devices[0].platform}); the mesh must use every device "
                          "exactly once")
    auto = (jax.sharding.AxisType.Auto,) * 2  # GSPMD propagation: the engine's programs need no annotations
    return jax.make_mesh((sizes["data"], sizes["model"]), AXES, axis_types=auto, devices=devices)



def check_mesh(mesh: Any, name: str = "mesh", *, needed_by: str | None = None) -> None:
    """A `jax.sharding.Mesh`, or None unless `needed_by` (the function that cannot run without one) is given;
    anything else, a "data=2,model=4" string included, is one ConfigError that says how to build one."""
    if mesh is None and needed_by is not None:
        raise ConfigError(f"{needed_by} needs a mesh, e.g. pj.make_mesh('data=2,model=4')")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ConfigError(f"{name} must be a jax.sharding.Mesh, e.g. pj.make_mesh({{'data': 1}}) or "
                          f"pj.make_mesh('data=2,model=4'), got {type(mesh).__name__} {mesh!r}")


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    return int(mesh.shape["data"]), int(mesh.shape["model"])



def on_mesh(mesh: Mesh | None):
    """The context a sharded run traces and runs under: `jax.set_mesh(mesh)`, so that code inside its programs sees
    the mesh (`jax.sharding.get_abstract_mesh()`; the Pallas kernels then run under `shard_map`, one kernel per
    device's shard, as XLA cannot partition their custom calls). No mesh: nothing changes."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
