"""Result files written whole or not at all: each goes to a temporary name in the same folder and is renamed into
place only when complete, so a failed, interrupted or killed run leaves the previous file byte-identical.

Temporaries are named `.NAME.tmp-PID-XXXXXXXX` (PID: the writing process). A later write of NAME removes the ones
whose process is gone (a run killed mid-write), and this process's own leftovers, before it writes (`clean_stale`).
Nothing here imports jax.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from parse_jax.errors import InputError

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")
_ACTIVE: set[Path] = set()  # temporaries this process is writing right now (never cleaned as stale)


def tmp_path(path: str | Path) -> Path:
    """A fresh temporary name next to `path`: `.NAME.tmp-PID-XXXXXXXX`."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    except OSError:
        return False
    return True


def clean_stale(folder: str | Path, name: str) -> list[Path]:
    """Remove the stale temporaries of `folder/name`: those of dead processes and this process's finished ones.
    Returns what was removed."""
    folder = Path(folder)
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TMP.match(p.name)
        if m is None or m.group("name") != name or p in _ACTIVE:
            continue
        pid = int(m.group("pid"))
        if pid != os.getpid() and _alive(pid):
            continue  # another live run is writing it
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """`with replacing(path) as tmp:` write `tmp` (a file or a folder); on success it is renamed to `path` (a
    folder replaces an old folder of that name), on any exception it is removed and `path` is untouched."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    clean_stale(path.parent, path.name)
    tmp = tmp_path(path)
    _ACTIVE.add(tmp)
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            old = tmp_path(path)
            os.replace(path, old)  # two renames: the old folder is gone only once the new one is complete
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        _ACTIVE.discard(tmp)
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists() or tmp.is_symlink():
            tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file (flushed to disk) and a rename."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a folder")
    with replacing(path) as tmp:
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def finite_json(obj: Any) -> Any:
    """`obj` with every NaN or infinite float (an undefined measure, e.g. an AUROC with no negatives) as None, so
    that it is written as `null`: strict JSON, which `json.dumps`' bare `NaN` / `Infinity` are not."""
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def json_text(obj: Any, indent: int | None = 2) -> str:
    """`obj` as strict JSON text (non-finite floats as null; anything else JSON cannot hold as its str())."""
    return json.dumps(finite_json(obj), indent=indent, default=str, allow_nan=False)


def write_json(path: str | Path, obj: Any) -> Path:
    """`obj` as strict JSON (`json_text`), written whole or not at all."""
    return write_text(path, json_text(obj) + "\n")


def check_writable(folder: str | Path) -> Path:
    """Prove that `folder` can be written (or created) without creating it: fail before any work, and leave no
    empty folder behind when the work then fails."""
    folder = Path(folder)
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"cannot write to output folder {folder}: {probe} is not a folder")
    test = probe / f".parse-jax-write-test-{os.getpid()}"
    try:
        test.write_bytes(b"")
        test.unlink()
    except OSError as e:
        raise InputError(f"cannot write to output folder {folder}: {e.strerror or e} ({probe})") from None
    return folder


def check_file_writable(path: str | Path) -> Path:
    """Prove that the file `path` can be written later (its folder writable or creatable, and not a folder)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a folder; give a file name")
    try:
        check_writable(path.parent)
    except InputError as e:
        raise InputError(f"cannot write {path}: {str(e).partition(': ')[2]}") from None
    return path
