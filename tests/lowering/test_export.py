"""Lowered programs written whole or not at all, and read back with `jax.export.deserialize`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.errors import InputError
from parse_jax.lowering.chips import chip
from parse_jax.lowering.export import lower_launch, target_context, write_lowered
from parse_jax.lowering.launches import Launch


def _program(x, scale):
    return {"y": x * scale["s"]}


def lowered(name="double", fail=False):
    target = chip("v5e")
    args = (np.ones((4, 8), np.float32), {"s": np.float32(2.0)})
    program = jax.jit(_program if not fail else lambda x, s: jnp.linalg.inv(x[None]))
    with target_context(target) as mesh:
        return lower_launch(Launch(name, program, args), target, mesh)


def test_a_program_is_exported_over_flat_arguments_and_deserializes():
    p = lowered()
    assert p.ok and p.input_paths == ("[0]", "[1]['s']")
    back = jax.export.deserialize(bytearray(p.serialize()))
    assert back.platforms == ("tpu",) and [a.shape for a in back.in_avals] == [(4, 8), ()]
    assert p.summary()["inputs"] == {"[0]": "float32[4, 8]", "[1]['s']": "float32[]"}


def test_a_failure_is_kept_with_its_reason():
    p = lowered("broken", fail=True)
    assert not p.ok and p.error == "ValueError: Argument to inv must have shape [..., n, n], got (1, 4, 8)."
    assert p.summary() == {"name": "broken", "lowered": False, "error": p.error}


def test_write_replaces_an_earlier_lowering_and_refuses_other_folders(tmp_path):
    out = tmp_path / "out"
    write_lowered(out, [lowered()], {"runs": 1})
    assert sorted(x.name for x in out.iterdir()) == ["double.jax_exported", "double.mlir", "report.json"]
    write_lowered(out, [lowered("other")], {"runs": 2})
    assert sorted(x.name for x in out.iterdir()) == ["other.jax_exported", "other.mlir", "report.json"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="not an earlier `parse-jax lower` folder"):
        write_lowered(tmp_path / "data", [lowered()], {})
    assert [x.name for x in (tmp_path / "data").iterdir()] == ["keep.txt"]
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]  # no temporary left behind
