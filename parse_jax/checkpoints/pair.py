"""The embedded default pair: a target and a draft trained by `parse-jax train --recipe pair_default`, shipped in
the package so that the engine, `parse-jax bench` and the tests run on any machine with no download."""

from __future__ import annotations

from pathlib import Path

import jax

from parse_jax.checkpoints.load import load_model
from parse_jax.checkpoints.orbax import CONFIG_FILE
from parse_jax.errors import CheckpointError
from parse_jax.models.model import Model
from parse_jax.speculation.eagle3 import load_eagle3

PAIR_DIR = Path(__file__).resolve().parents[1] / "assets" / "pair"
EAGLE3_DIR = "eagle3"


def load_pair(path: str | Path | None = None, dtype: str | None = None) -> tuple[Model, Model]:
    """(target, draft) from a folder holding `target/` and `draft/` model folders (Orbax or HF); no argument: the
    pair shipped in the package. A folder written by `parse-jax train --out DIR` is such a folder. An `eagle3/`
    head folder beside them (`parse-jax train-eagle3`) is loaded as `target.eagle3`.

    `dtype` None: the embedded pair loads as float32 (its target is stored in bfloat16, half the package), and so
    does a parse-jax checkpoint (what `pj.save_model` and `parse-jax train` write) in any other pair folder when the
    models load on CPUs (bfloat16 matmuls are several times slower than float32 there, and float32 keeps greedy
    identities exact; on an accelerator it keeps its stored dtype, as a large model must); a Hugging Face folder
    loads as `pj.load_model` loads it. Give `dtype` to load both in it."""
    folder = PAIR_DIR if path is None else Path(path)
    missing = [name for name in ("target", "draft") if not (folder / name).is_dir()]
    if missing:
        what = "the embedded pair is missing from this install" if path is None else f"{folder} is not a pair folder"
        raise CheckpointError(f"{what}: no {' or '.join(m + '/' for m in missing)} in {folder} "
                              "(make one with `parse-jax train --recipe pair_default --out DIR`)")
    if path is None and dtype is None:
        dtype = "float32"
    target, draft = (load_model(folder / name, dtype=pair_dtype(folder / name, dtype)) for name in ("target", "draft"))
    if target.config.vocab_size != draft.config.vocab_size:
        raise CheckpointError(f"{folder}: target and draft vocabularies differ ({target.config.vocab_size} vs "
                              f"{draft.config.vocab_size})")
    if (folder / EAGLE3_DIR).is_dir():
        target.eagle3 = load_eagle3(folder / EAGLE3_DIR, target)  # ParseEngine's default head for this target
    return target, draft


def pair_dtype(model_folder: Path, dtype: str | None) -> str | None:
    """The dtype `load_pair` loads one model of a pair in: `dtype` if given, else float32 for a parse-jax checkpoint
    loaded on CPUs and None (as `pj.load_model` loads it) for anything else: a checkpoint on an accelerator, a
    Hugging Face folder, a training run."""
    if dtype is not None:
        return dtype
    return "float32" if (model_folder / CONFIG_FILE).is_file() and jax.default_backend() == "cpu" else None
