"""Where a model may be saved, checked before anything is read or written: every writer of model folders (Orbax
checkpoints, HF exports) asks the same question."""

from __future__ import annotations

import os
from pathlib import Path

from parse_jax.errors import CheckpointError


def check_save_path(path: str | Path, overwrite: bool = False) -> Path:
    """Whether a model can be saved at `path`, checked without writing anything (what `convert` asks before it
    reads a tensor): an existing path is an error unless `overwrite`, and so are a path that is not a folder, a
    file in the way and a folder without write permission."""
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a folder")
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"cannot write {path}: {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise CheckpointError(f"cannot write {path}: no write permission in {parent}")
            break
    return path
