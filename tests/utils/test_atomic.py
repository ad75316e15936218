"""parse_jax.utils.atomic: results written whole or not at all, stale temporaries of dead runs cleaned by the next
write."""

import os
import subprocess
import sys

import pytest

from parse_jax.errors import InputError
from parse_jax.utils.atomic import check_file_writable, check_writable, clean_stale, replacing, write_json, write_text


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_failed_write_leaves_the_old_file_byte_identical(tmp_path):
    path = tmp_path / "r.json"
    path.write_bytes(b"old result\n")
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text("half a new res")
            raise RuntimeError("interrupted")
    assert path.read_bytes() == b"old result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left
    write_json(path, {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.subprocess
def test_stale_temporaries_of_dead_runs_are_removed_and_live_ones_kept(tmp_path):
    dead = tmp_path / f".r.json.tmp-{_dead_pid()}-0123abcd"
    dead.write_text("killed mid-write")
    dead_dir = tmp_path / f".r.json.tmp-{_dead_pid()}-89abcdef"
    dead_dir.mkdir()
    (dead_dir / "x").write_text("x")
    live = tmp_path / f".r.json.tmp-{os.getppid()}-00000000"  # the parent process: alive
    live.write_text("another run writing now")
    other = tmp_path / f".other.json.tmp-{_dead_pid()}-00000000"  # another file's: not ours to clean
    other.write_text("")
    write_text(tmp_path / "r.json", "new\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r.json", live.name, other.name])
    assert clean_stale(tmp_path, "other.json") == [other]


def test_a_folder_result_replaces_the_old_folder_only_when_complete(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "a").write_text("old")
    with pytest.raises(KeyError):
        with replacing(out) as tmp:
            tmp.mkdir()
            (tmp / "a").write_text("new")
            raise KeyError("killed")
    assert (out / "a").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model"]
    with replacing(out) as tmp:
        tmp.mkdir()
        (tmp / "b").write_text("new")
    assert [p.name for p in out.iterdir()] == ["b"] and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_checks_create_nothing(tmp_path):
    check_writable(tmp_path / "a" / "b")
    check_file_writable(tmp_path / "c" / "r.json")
    assert list(tmp_path.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InputError, match="cannot write to output folder"):
        check_writable(blocker / "d")
    with pytest.raises(InputError, match="is a folder"):
        check_file_writable(tmp_path)
    with pytest.raises(InputError, match="is a folder"):
        write_text(tmp_path, "x")


def test_json_is_strict_with_non_finite_floats_as_null(tmp_path):
    import json

    import numpy as np

    obj = {"nan": float("nan"), "inf": [float("inf"), np.float32("-inf"), np.float64(2.5)], "big": 2**80, "t": (1,)}
    path = write_json(tmp_path / "r.json", obj)

    def refuse(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {"nan": None, "inf": [None, None, 2.5],
                                                                   "big": 2**80, "t": [1]}
