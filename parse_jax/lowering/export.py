"""Lower a run's programs for a TPU or a GPU from any machine (`jax.export`), and write them with a report.

Each program is traced under `jax.sharding.use_abstract_mesh` of the target chip (`chips.abstract_mesh`): the
attention implementation "pallas" resolves to that platform's kernel (Mosaic for TPU, Triton for CUDA) with tiles
for that chip (`pallas_kernels.tiles`), and `jax.export.export(..., platforms=[platform])` lowers it to StableHLO
holding the kernel as a custom call (`tpu_custom_call`, `__gpu$xla.gpu.triton`). A program that cannot be lowered
is kept in the result with its reason; nothing is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from parse_jax.errors import InputError
from parse_jax.lowering.chips import Chip, abstract_mesh
from parse_jax.lowering.launches import Launch, abstract_tree
from parse_jax.utils.atomic import check_writable, replacing

KERNEL_CALLS = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
_CUSTOM_CALL = re.compile(r"custom_call @([\w$.\-]+)")


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
    """One program of a run, lowered (`exported`) or not (`error` says why)."""

    name: str
    platform: str
    exported: Any = None
    error: str | None = None
    seconds: float = 0.0
    input_paths: tuple[str, ...] = ()  # the flattened arguments' paths in the program's argument tuple

    @property
    def ok(self) -> bool:
        return self.exported is not None

    @property
    def text(self) -> str:
        """The lowered module (StableHLO, MLIR text)."""
        return self.exported.mlir_module() if self.ok else ""

    @property
    def custom_calls(self) -> dict[str, int]:
        """Custom call target -> how many times the module calls it."""
        out: dict[str, int] = {}
        for name in _CUSTOM_CALL.findall(self.text):
            out[name] = out.get(name, 0) + 1
        return dict(sorted(out.items()))

    @property
    def has_kernel(self) -> bool:
        """Whether the platform's Pallas kernel is in the module."""
        return KERNEL_CALLS[self.platform] in self.custom_calls

    @property
    def in_shardings(self) -> tuple:
        """Each input's `NamedSharding` over the abstract mesh (None: unspecified, e.g. off a mesh). jax keeps them
        on `Exported._in_named_shardings` since its HloShardings were retired (jax 0.10)."""
        named = getattr(self.exported, "_in_named_shardings", None)
        return tuple(named) if named is not None else tuple(self.exported.in_shardings_hlo)

    def serialize(self) -> bytes:
        return bytes(self.exported.serialize())

    def summary(self) -> dict[str, Any]:
        if not self.ok:
            return {"name": self.name, "lowered": False, "error": self.error}
        e = self.exported
        return {"name": self.name, "lowered": True, "seconds": round(self.seconds, 3),
                "inputs": {path: _describe(a, s) for path, a, s in zip(self.input_paths, e.in_avals,
                                                                        self.in_shardings, strict=True)},
                "outputs": [_describe(a, None) for a in e.out_avals],
                "input_bytes": int(sum(_nbytes(a) for a in e.in_avals)),
                "custom_calls": self.custom_calls, "kernel": self.has_kernel}


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _describe(aval, sharding) -> str:
    text = f"{np.dtype(aval.dtype).name}{list(aval.shape)}"
    spec = getattr(sharding, "spec", None)
    return text if spec is None or all(a is None for a in spec) else f"{text} over {tuple(spec)}"


def _disabled_checks(platform: str) -> list:
    if platform == "cuda":  # the Triton kernel is a custom call jax.export does not vouch for across versions
        return [jax.export.DisabledSafetyCheck.custom_call(KERNEL_CALLS["cuda"])]
    return []


def lower_launch(launch: Launch, target: Chip, mesh) -> LoweredProgram:
    """Export one program for `target` (called under `use_abstract_mesh(mesh)`); failures are kept, named.

    The program is exported over its flattened arguments and results (a tuple of arrays each way; `input_paths`
    names them), so the serialized artifact holds no parse-jax types and deserializes anywhere."""
    t0 = time.perf_counter()
    try:
        with_paths, in_tree = jax.tree_util.tree_flatten_with_path(
            abstract_tree(launch.args, None if mesh.size == 1 else mesh))
        leaves = [x for _, x in with_paths]

        def flat(*xs):
            return tuple(jax.tree.leaves(launch.program(*jax.tree.unflatten(in_tree, xs))))

        exported = jax.export.export(jax.jit(flat), platforms=[target.platform],
                                     disabled_checks=_disabled_checks(target.platform))(*leaves)
    except Exception as e:  # noqa: BLE001 - any failure of one program is reported, the others still lower
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return LoweredProgram(launch.name, target.platform, error=f"{type(e).__name__}: {first[:400]}",
                              seconds=time.perf_counter() - t0)
    paths = tuple(jax.tree_util.keystr(path) for path, _ in with_paths)
    return LoweredProgram(launch.name, target.platform, exported=exported, seconds=time.perf_counter() - t0,
                          input_paths=paths)


class target_context:
    """`with target_context(chip, sizes) as mesh:` traces and lowers for `chip` on a (data, model) mesh of
    `sizes` (default one chip)."""

    def __init__(self, target: Chip, sizes: dict[str, int] | None = None) -> None:
        self.mesh = abstract_mesh(target, sizes)
        self._inner = jax.sharding.use_abstract_mesh(self.mesh)

    def __enter__(self):
        self._inner.__enter__()
        return self.mesh

    def __exit__(self, *exc) -> None:
        self._inner.__exit__(*exc)


def check_lowered_folder(out_dir: str | Path) -> Path:
    """`out_dir` if `write_lowered` may write there: new (and creatable), empty, or an earlier lowering's. Checked
    before lowering too, so a bad `--out` costs no lowering."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "report.json")
                                                       .is_file())):
        raise InputError(f"--out {out_dir} exists and is not an earlier `parse-jax lower` folder (no report.json); "
                         "choose a new or empty folder")
    check_writable(out_dir)
    return out_dir


def write_lowered(out_dir: str | Path, programs: list[LoweredProgram], report: dict[str, Any]) -> Path:
    """`out_dir/` with one `<name>.jax_exported` (serialized `jax.export.Exported`, read back with
    `jax.export.deserialize`) and `<name>.mlir` per lowered program, and `report.json`; written whole or not at
    all (a temporary folder renamed into place). An earlier lowering there is replaced; any other non-empty folder
    is refused."""
    out_dir = check_lowered_folder(out_dir)
    with replacing(out_dir) as tmp:
        tmp.mkdir()
        for p in programs:
            if p.ok:
                (tmp / f"{p.name}.jax_exported").write_bytes(p.serialize())
                (tmp / f"{p.name}.mlir").write_text(p.text)
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return out_dir
