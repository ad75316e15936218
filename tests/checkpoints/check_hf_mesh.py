"""Run with 8 fake CPU devices (XLA_FLAGS set by tests/checkpoints/test_hf_mesh.py): HF folders loaded straight into a
mesh. Writes JSON measurements to argv[2]: per folder and mesh, whether params and logits equal the one-device load,
and every slice each callback read from the safetensors files next to the slice its device holds."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy

from parse_jax.checkpoints import hf as hf_import
from parse_jax.checkpoints.load import load_model
from parse_jax.checkpoints.orbax import params_equal
from parse_jax.distributed.mesh import make_mesh
from parse_jax.errors import CheckpointError


def _norm(index, shape) -> list[list[int]]:
    """A tuple of slices as [start, stop] per dimension."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)] if index else [[0, n] for n in shape]


def main(root: Path, out: Path) -> None:
    reads: list[tuple[str, list[list[int]], int]] = []
    original = hf_import._Entry.read_slice

    def spy(self, index):
        array = original(self, index)
        reads.append((self.name, _norm(tuple(index), self.shape), int(array.size)))
        return array

    hf_import._Entry.read_slice = spy
    results = []
    ids = np.random.default_rng(0).integers(0, 300, size=(4, 9))
    for name in ("qwen3-sharded", "qwen2-bf16"):
        folder = root / name
        plain = load_model(folder)
        for spec, fallback in (("4x2", False), ("1x8", True)):
            d, m = map(int, spec.split("x"))
            mesh = make_mesh({"data": d, "model": m})
            reads.clear()
            model = load_model(folder, mesh=mesh, fallback_replicated=fallback)
            # what each device holds, in the file's orientation ([out, in] for kernels)
            holds: dict[str, list[list[list[int]]]] = {}
            sizes: dict[str, int] = {}
            for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
                hf, transpose = hf_import.hf_name(tuple(k.key for k in path))
                shards = []
                for index in leaf.sharding.devices_indices_map(leaf.shape).values():
                    s = _norm(index, leaf.shape)
                    shards.append(s[::-1] if transpose else s)
                holds[hf] = shards
                sizes[hf] = int(np.prod(leaf.shape))
            read_by: dict[str, list] = {}
            for tensor, index, size in reads:
                read_by.setdefault(tensor, []).append([index, size])
            results.append({
                "folder": name, "mesh": spec, "type": type(model).__name__,
                "params_equal": params_equal(jax.device_get(model.params), jax.device_get(plain.params)),
                "logits_diff": float(np.abs(model.logits(ids) - plain.logits(ids)).max()),
                "logits_scale": float(np.abs(plain.logits(ids)).max()),
                "holds": holds, "sizes": sizes, "reads": read_by,
                "split": sorted(k for k, v in holds.items() if any(np.prod([b - a for a, b in s]) < sizes[k]
                                                                   for s in v)),
            })
    hf_import._Entry.read_slice = original
    out.write_text(json.dumps({"loads": results, "non_finite": _non_finite_error(root)}))


def _non_finite_error(root: Path) -> str:
    """A NaN in one tensor of a sharded folder, loaded into a mesh: the error the slice readers raise."""
    bad = root / "qwen3-nan"
    shutil.copytree(root / "qwen3-sharded", bad)
    name = "model.layers.1.mlp.up_proj.weight"
    index = json.loads((bad / hf_import.INDEX_FILE).read_text())["weight_map"]
    file = bad / index[name]
    tensors = safetensors.numpy.load_file(str(file))
    tensors[name][3, 5] = np.nan
    safetensors.numpy.save_file(tensors, str(file), metadata={"format": "pt"})
    try:
        load_model(bad, mesh=make_mesh({"data": 4, "model": 2}))
    except CheckpointError as e:
        return str(e)
    return "loaded"


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    main(Path(sys.argv[1]), Path(sys.argv[2]))
