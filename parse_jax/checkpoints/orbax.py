"""parse-jax checkpoints (Orbax params + config JSON + tokenizer files) and the one loader for both formats.

A checkpoint folder holds:
  parse_jax_config.json   `ModelConfig.to_dict()`: the marker that this is our format
  params/                 an Orbax checkpoint of the param tree, in the config's dtype
  tokenizer.json ...      the tokenizer files, when the model has a tokenizer

`save_model` writes everything into a hidden sibling folder and renames it into place at the end, so
a crash or an error never leaves a half-written checkpoint under the requested name.
"""

from __future__ import annotations

import gc
import glob
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from parse_jax.checkpoints.hf import check_vocab
from parse_jax.checkpoints.save_path import check_save_path
from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model, expected_params, param_mismatches, unflatten
from parse_jax.models.tokenizer import Tokenizer

CONFIG_FILE = "parse_jax_config.json"



PARAMS_DIR = "params"



def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())



def check_params(params: Any, cfg: ModelConfig) -> None:
    """Params must be exactly the tree `cfg` implies (names, shapes, dtypes), so every saved checkpoint loads."""
    problems = param_mismatches(params, cfg)
    if problems:
        raise CheckpointError(f"params do not match the model config ({cfg.architecture}, dtype {cfg.dtype}): "
                              + "; ".join(problems))



def _prepare_parent(path: Path) -> None:
    """Create the folder `path` goes into, or a CheckpointError naming the path (a file in the way, no
    permission) instead of a raw OSError."""
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"cannot write {path}: {parent} is a file, not a folder")
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: cannot create {path.parent} ({e.strerror or e})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {path}: no write permission in {path.parent}")



def _tmp_owner(tmp: Path) -> int | None:
    """The process id in a temporary folder's name (`.NAME.tmp-PID-XXXX`); None for older names without one."""
    match = re.fullmatch(r"\..+\.(?:tmp|old)-(\d+)-[0-9a-f]+", tmp.name)
    return int(match.group(1)) if match else None



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True



def clean_stale_temporaries(path: Path, started: float) -> list[Path]:
    """Remove the hidden `.NAME.tmp-*` / `.NAME.old-*` folders earlier killed saves of `path` left behind: those
    whose writer process is gone, or (names without a process id) older than this run's start `started`
    (a time.time()). A live writer's folder is kept. Returns what was removed."""
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*-*"):
        if not re.fullmatch(rf"\.{re.escape(path.name)}\.(tmp|old)-[0-9a-f-]+", tmp.name) or not tmp.is_dir():
            continue
        pid = _tmp_owner(tmp)
        try:
            stale = not _alive(pid) if pid is not None else tmp.stat().st_mtime < started
        except OSError:
            continue
        if stale:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed



def save_model(model: Model, path: str | Path, overwrite: bool = False) -> Path:
    """Write `model` as a parse-jax checkpoint at `path`; an existing path is an error unless `overwrite`.
    Temporary folders of earlier killed saves to the same path are removed first."""
    started = time.time()
    path = Path(path).absolute()
    check_params(model.params, model.config)
    check_save_path(path, overwrite)
    _prepare_parent(path)
    clean_stale_temporaries(path, started)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        try:
            tmp.mkdir()
        except OSError as e:
            raise CheckpointError(f"cannot write {path}: cannot create {tmp} ({e.strerror or e})") from None
        (tmp / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
        if model.tokenizer is not None:
            model.tokenizer.save(tmp)
        with _checkpointer() as checkpointer:  # synchronous: nothing still writes once it returns
            checkpointer.save(tmp / PARAMS_DIR, args=ocp.args.StandardSave(model.params))
        if path.exists():  # overwrite: move the old one aside first, so some complete copy always exists
            old = path.parent / f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path



def restore_params(folder: Path, cfg: ModelConfig, target: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check the stored tree against `cfg` from Orbax's metadata first (one clear message, and no failing
    reads left in flight), then restore with the config's shapes/dtypes so bfloat16 stays bfloat16.
    `target`: an abstract tree with shardings to restore into (default: everything on the first device)."""
    folder = Path(folder).absolute()
    params_dir = folder / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"parse-jax checkpoint {folder} has no {PARAMS_DIR}/ folder")
    if target is None:
        target = abstract_params_one_device(cfg)
    where = f"params in {params_dir} for the config in {CONFIG_FILE}"
    _quiet_orbax_leftovers()  # before the reads start: a failed read's callbacks can print while Orbax unwinds
    with _RESTORES_LOCK:
        _RESTORES_IN_FLIGHT[0] += 1
    try:
        with _checkpointer() as checkpointer:
            stored = checkpointer.metadata(params_dir).item_metadata
            if stored is None:
                raise CheckpointError(f"{params_dir} holds no readable Orbax metadata (damaged or incomplete)")
            problems = param_mismatches(getattr(stored, "tree", stored), cfg)
            if problems:
                raise CheckpointError(f"{where} do not match it ({cfg.architecture}, dtype {cfg.dtype}): "
                                      + "; ".join(problems))
            return checkpointer.restore(params_dir, args=ocp.args.StandardRestore(target))
    except CheckpointError:
        raise
    except Exception as e:  # Orbax/TensorStore raise many types (some bare Exception) for damaged data
        _FAILED_FOLDERS.add(_tensorstore_path(params_dir))  # still in flight: its leftovers are recognised throughout
        problem = _orbax_problem(e)
    finally:
        with _RESTORES_LOCK:
            _RESTORES_IN_FLIGHT[0] -= 1
    gc.collect()  # the failed reads' coroutines now, while the hooks drop what they print
    raise CheckpointError(f"cannot restore {where}: {problem}")



def _tensorstore_path(params_dir: Path) -> str:
    """A folder as TensorStore writes it in its errors: absolute, `..` resolved, links kept, a trailing separator."""
    return os.path.join(os.path.abspath(params_dir), "")


_FAILED_FOLDERS: set[str] = set()  # params folders (with a trailing separator) whose restore failed in this process
_RESTORES_IN_FLIGHT = [0]  # restores running now (in any thread), counted under _RESTORES_LOCK
_RESTORES_LOCK = threading.Lock()
_ORBAX_PACKAGE = os.path.join("orbax", "checkpoint", "")  # in the path of Orbax's own modules


def _restores_failed_or_running() -> bool:
    """Whether a restore is in flight or one has failed in this process: until then the hooks drop nothing."""
    return bool(_RESTORES_IN_FLIGHT[0] or _FAILED_FOLDERS)


def _is_orbax_leftover(obj: Any, value: BaseException | None) -> bool:
    if not _restores_failed_or_running():
        return False
    code = getattr(obj, "cr_code", None)
    if code is not None and "orbax" in code.co_filename:
        return True
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def _is_failed_read(value: BaseException) -> bool:
    """An error of one of a failed restore's reads: TensorStore's names the folder it read, Orbax's (a gather of
    reads) was raised in Orbax's modules."""
    return (any(folder in str(value) for folder in _FAILED_FOLDERS)
            or any(_ORBAX_PACKAGE in frame.f_code.co_filename for frame, _ in traceback.walk_tb(value.__traceback__)))


class _UnretrievedReadFilter(logging.Filter):
    """Drops asyncio's "exception was never retrieved" records of a failed restore's reads, and its records of the
    reads' callbacks that found Orbax's event loop closed (`_is_orbax_leftover`, as the hooks drop them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        value = record.exc_info[1] if record.exc_info else None
        if value is None or not _restores_failed_or_running():
            return True
        unretrieved = "exception was never retrieved" in str(record.msg)
        return not ((unretrieved and _is_failed_read(value)) or _is_orbax_leftover(None, value))


def _quiet_orbax_leftovers() -> None:
    """Orbax leaves the other reads of a failed restore as coroutines that raise when collected, each printing
    a 60-line TensorStore dump ("Exception ignored in ..."): `restore_params` collects them at once, and these hooks
    drop the ones collected later (a read still referenced by a pending task is collected at exit), so the user sees
    one line. They also drop what the reads' callbacks print when they find Orbax's event loop closed
    (`RuntimeError: Event loop is closed`, at any moment, also before the restore's error reaches parse-jax: seen
    under load), and asyncio's records of the reads' futures whose errors nobody retrieved ("Future exception was
    never retrieved") naming a failed folder or raised in Orbax's modules (`_UnretrievedReadFilter`). Installed
    before a restore starts; they drop nothing until a restore is in flight or one has failed, and every other
    error is printed as before."""
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _UnretrievedReadFilter) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_UnretrievedReadFilter())
    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook
    if getattr(previous_unraisable, "drops_orbax_leftovers", False):
        return

    def unraisablehook(unraisable):
        if not _is_orbax_leftover(unraisable.object, unraisable.exc_value):
            previous_unraisable(unraisable)

    def excepthook(kind, value, tb):
        if not _is_orbax_leftover(None, value):
            previous_except(kind, value, tb)

    previous_thread = threading.excepthook

    def thread_excepthook(args):  # Orbax's reader threads, after the event loop they call back into has closed
        if not _is_orbax_leftover(None, args.exc_value):
            previous_thread(args)

    unraisablehook.drops_orbax_leftovers = True
    sys.unraisablehook, sys.excepthook = unraisablehook, excepthook
    threading.excepthook = thread_excepthook



def _orbax_problem(error: BaseException) -> str:
    """One line from an Orbax/TensorStore failure (often a 60-line spec dump): the param whose data could not be
    read (TensorStore names its key, e.g. `layers_1.self_attn.k_proj.kernel`) and the root cause."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    text = "\n".join(str(x) for x in chain)
    keys = [k for k in re.findall(r"'path': '([^'/][^']*?)/?'", text) if not k.startswith("/")]
    keys += re.findall(r'Error reading "([^"/]+)/', text)
    cause = next((line for x in reversed(chain) for line in str(x).splitlines()[:1] if line.strip()), repr(chain[-1]))
    cause = cause if len(cause) <= 400 else cause[:400] + "..."
    if keys:
        return f"the data of param {keys[-1].replace('.', '/')} is damaged or unreadable ({cause})"
    return cause



def abstract_params_one_device(cfg: ModelConfig) -> dict[str, Any]:
    """The param tree `cfg` implies as `ShapeDtypeStruct`s on the first device: a restore target (no memory)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return unflatten({path: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
                      for path, leaf in expected_params(cfg).items()})



def read_config(folder: Path) -> ModelConfig:
    """The `ModelConfig` of a parse-jax checkpoint folder (its parse_jax_config.json)."""
    try:
        d = json.loads((folder / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{folder / CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{folder / CONFIG_FILE} must hold a JSON object")
    return ModelConfig.from_dict(d)



def check_finite_params(params: Any, where: str) -> None:
    """NaN/inf weights give garbage text far from their cause: refuse them at load time."""
    bad = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
           if not bool(jnp.isfinite(x).all())]
    if bad:
        raise CheckpointError(f"checkpoint {where} has non-finite values (inf/nan) in: {', '.join(bad)}")



def cast_params(cfg: ModelConfig, params: Any, dtype: str | None) -> tuple[ModelConfig, Any]:
    """(config, params) in `dtype` (None: as stored); elementwise, so each array keeps its sharding."""
    if dtype is None or dtype == cfg.dtype:
        return cfg, params
    return cfg.replace(dtype=dtype), jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)



def folder_tokenizer(folder: Path, cfg: ModelConfig) -> Tokenizer | None:
    """The tokenizer files of `folder` (None when it has no tokenizer.json), checked against the embedding."""
    if not (folder / "tokenizer.json").is_file():
        return None
    tokenizer = Tokenizer.from_folder(folder)
    check_vocab(tokenizer, cfg)
    return tokenizer



def load_orbax(folder: Path, dtype: str | None, check_finite: bool, attention_impl: str) -> Model:
    cfg = read_config(folder)
    params = restore_params(folder, cfg)
    if check_finite:
        check_finite_params(params, str(folder))
    cfg, params = cast_params(cfg, params, dtype)
    return Model(cfg, params, folder_tokenizer(folder, cfg), attention_impl)



def params_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same tree, shapes, dtypes and bits (NaN-safe): what a lossless round trip must give."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True
