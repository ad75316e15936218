"""One step of an Orbax `CheckpointManager` folder (a training run) as a `Model`: only its params are read.

What `ocp.CheckpointManager` writes, and what is read here::

    RUN/run.json                    this project's runs (parse_jax/train/trainer.py): the run's fingerprint, whose
                                    "model" entry is the ModelConfig; other runs give `config_from=`
    RUN/ckpt/<step>/<item>/         a finished step, one subfolder per item: the trainer writes `state`
                                    ({"params", "opt_state"}) and `meta` (JSON); a single-item manager `default`.
                                    <step> is named as the run's manager names steps (23, 0023, step_23,
                                    step_0023), found with Orbax's step utilities
    RUN/ckpt/<step>.orbax-checkpoint-tmp-<time>/   a step still being written: never read

`path` may be the run folder (holding `ckpt/`), the CheckpointManager folder itself, or one step's folder, on any
path etils.epath and Orbax accept (a local folder, gs://...).

The params are one sub-tree of one item (`state/params`, beside the optimizer state). It is found from Orbax's
tree metadata (no array is read for that): every dict holding `embed_tokens` is a candidate, and those named
`params` (or an item that is the tree itself) win, so optax's `mu`/`nu` copies of the params do not compete.
Then that sub-tree alone is restored with Orbax's partial restore, so the optimizer state is never read into
memory; with a mesh, the restore target carries `parse_jax.models.sharding.abstract_params`' NamedShardings and
each device reads only its own slices (as `load_sharded` does for a parse-jax checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import operator
import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from parse_jax.checkpoints.hf import INDEX_FILE, SINGLE_FILE
from parse_jax.checkpoints.orbax import (
    CONFIG_FILE,
    PARAMS_DIR,
    abstract_params_one_device,
    cast_params,
    check_finite_params,
    folder_tokenizer,
    read_config,
)
from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.config import DTYPES, ModelConfig, read_hf_config
from parse_jax.models.model import Model, param_mismatches
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.utils.validation import shorten

TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax's name marker of a folder being written (renamed away when complete)
RUN_FILE = "run.json"               # this project's trainer: the run's fingerprint (documented, not imported)
CKPT_DIR = "ckpt"                   # this project's trainer: RUN/ckpt/ is the CheckpointManager folder
PYTREE_METADATA = "_METADATA"       # a PyTree (Standard/PyTree handler) item's tree metadata file
COMMIT_FILE = "commit_success.txt"  # Orbax writes it last into each step (the marker where renames are not atomic)
OCDBT_PROCESS = "ocdbt.process_"     # Orbax's per-process folders inside an item (named like prefixed steps)


# ------------------------------------------------------------------------------------------------ steps
# Paths go through etils.epath (local, gs:// and any other path Orbax accepts); step names are read with Orbax's own
# step utilities (`ocp.step`), so every name format a CheckpointManager writes is found: the default (`23`), zero
# padded (`step_format_fixed_length`: `0023`) and prefixed (`step_prefix`: `step_23`, `step_0023`).


def is_remote(path: Any) -> bool:
    """A path with a scheme (gs://, s3://...), read through etils.epath's backends."""
    return "://" in str(path)


def shown_path(path: Any) -> str | None:
    """`path` as provenance records it: a local one resolved, a remote one (gs://...) as given; None for None."""
    return None if path is None else str(path) if is_remote(path) else str(Path(path).resolve())


def as_path(path: Any) -> epath.Path:
    """`path` as an epath.Path (a local path made absolute; gs:// and other remote paths as they are)."""
    p = epath.Path(path)
    return p if is_remote(path) else p.absolute()


def _name_prefix(name: str) -> str | None:
    """The step prefix a step folder's name (finished or temporary) is written with: "" for `23` / `0023`, "step"
    for `step_23`; None for any other name, Orbax's own per-process folders (`ocdbt.process_0`) included."""
    base = name.split(TMP_MARK)[0]
    if base.isdigit():
        return ""
    m = re.fullmatch(ocp.step.ALLOWED_STEP_NAME_PATTERN, base)
    return m.group(1) if m and not base.startswith(OCDBT_PROCESS) else None


def step_prefix(folder: epath.Path) -> str | None:
    """The prefix of `folder`'s step folders, as a manager names them all: "" where any is a plain number (a manager
    without `step_prefix`), else the prefix most of them share; None where `folder` has no step folder. A subfolder
    named otherwise (`eval_results_7/` beside `7/`) is not a step, as Orbax, told the manager's prefix, reads it."""
    if not folder.is_dir():
        return None
    found = [p for c in folder.iterdir() if c.is_dir() and (p := _name_prefix(c.name)) is not None]
    if not found:
        return None
    return "" if "" in found else max(sorted(set(found)), key=found.count)


def _step_of(name: str, prefix: str) -> int | None:
    """The step a finished step folder's name gives where the manager's steps are named with `prefix` (Orbax's
    formats: `23`, `0023`, `PREFIX_23`), None for any other name (a temporary folder included)."""
    if TMP_MARK in name or _name_prefix(name) != prefix:
        return None
    return ocp.step.step_from_checkpoint_name(name)


def _tmp_step_of(name: str, prefix: str) -> int | None:
    """The step of a temporary folder `<name>.orbax-checkpoint-tmp-<time>` of a manager naming steps with `prefix`."""
    m = re.match(ocp.step.TMP_DIR_STEP_PATTERN, name)
    return int(m.group(1)) if m and _name_prefix(name) == prefix else None


def _is_manager(folder: epath.Path) -> bool:
    """A folder with step subfolders (finished or being written)."""
    return step_prefix(folder) is not None


def _has_config(folder: epath.Path) -> bool:
    return (folder / CONFIG_FILE).is_file() or (folder / "config.json").is_file()


def _is_model_folder(folder: epath.Path) -> bool:
    """A HF or parse-jax model folder: a config and its weights (a manager may keep a config beside its steps)."""
    return (((folder / CONFIG_FILE).is_file() and (folder / PARAMS_DIR).is_dir())
            or ((folder / "config.json").is_file()
                and ((folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file())))


def locate(path: Any, step: int | None = None) -> tuple[epath.Path, int | None] | None:
    """(CheckpointManager folder, step) for a run folder, a CheckpointManager folder or one step's folder;
    None when `path` is none of them (a plain model folder, even one with subfolders named like steps)."""
    path = as_path(path)
    try:
        return _locate(path, step)
    except ImportError as e:  # etils' gs:// (and other remote) backends are optional installs
        raise CheckpointError(f"cannot read {path}: {e}") from None


def _locate(path: epath.Path, step: int | None) -> tuple[epath.Path, int | None] | None:
    if _is_model_folder(path):
        return None  # a model folder, even one named like a step (exports per step: out/1000/, out/2000/)
    if _is_manager(path):
        return path, step
    if _has_config(path):
        return None
    if _is_manager(path / CKPT_DIR) or ((path / CKPT_DIR).is_dir() and (path / RUN_FILE).is_file()):
        return path / CKPT_DIR, step
    parent_prefix = step_prefix(path.parent) if _name_prefix(path.name) is not None else None
    own = None if parent_prefix is None else _step_of(path.name, parent_prefix)
    if own is not None:
        if step is not None and _as_step(step) != own:
            raise CheckpointError(f"{path} is the folder of step {own}, but step={step} was asked for")
        return path.parent, own
    return None


def _as_step(step: Any) -> int:
    if isinstance(step, bool):
        raise ConfigError(f"step must be an integer, got {step!r}")
    try:
        return operator.index(step)
    except TypeError:
        raise ConfigError(f"step must be an integer, got {step!r}") from None


def list_steps(manager: Any) -> tuple[dict[int, epath.Path], dict[int, epath.Path]]:
    """({step: folder} of finished steps, {step: folder} of steps still being written), as Orbax tells them apart:
    a temporary folder (`ocp.step.is_path_temporary`: a `.orbax-checkpoint-tmp` name, or on object stores a step
    without its commit marker) or a folder Orbax does not call finalized; besides, a step with an item still in a
    temporary folder, and, where the other steps carry Orbax's commit marker, a step without it. Two finished
    folders naming one step (`5` and `step_5`) are an error."""
    done: dict[int, epath.Path] = {}
    writing: dict[int, epath.Path] = {}
    manager = as_path(manager)
    prefix = step_prefix(manager) or ""
    for c in manager.iterdir():
        if not c.is_dir():
            continue
        if (s := _tmp_step_of(c.name, prefix)) is not None:
            writing[s] = c
        elif (s := _step_of(c.name, prefix)) is not None:
            if (ocp.step.is_path_temporary(c) or not ocp.step.is_path_finalized(c)
                    or any(TMP_MARK in item.name for item in c.iterdir())):
                writing[s] = c
            elif s in done:
                raise CheckpointError(f"step {s} is named twice in {manager}: {done[s].name} and {c.name}")
            else:
                done[s] = c
    if any((d / COMMIT_FILE).is_file() for d in done.values()):
        for s in [s for s, d in done.items() if not (d / COMMIT_FILE).is_file()]:
            writing[s] = done.pop(s)
    return done, writing


def _steps_text(steps: dict[int, Path]) -> str:
    shown = [str(s) for s in sorted(steps)]
    return ", ".join(shown if len(shown) <= 20 else [*shown[:5], "...", *shown[-10:]]) + (
        f" ({len(shown)} steps)" if len(shown) > 20 else "")


def select_step(manager: epath.Path, step: int | None) -> tuple[int, epath.Path]:
    """(step, folder): `step`, or the latest finished one; a missing step or one still being written is an error."""
    done, writing = list_steps(manager)
    if step is None:
        if not done:
            busy = f" (step {_steps_text(writing)} still being written)" if writing else ""
            raise CheckpointError(f"no finished checkpoint step in {manager}{busy}")
        latest = max(done)
        return latest, done[latest]
    step = _as_step(step)
    if step in done:
        return step, done[step]
    if step in writing:
        raise CheckpointError(f"step {step} in {manager} is still being written ({writing[step].name}); "
                              "wait until Orbax finishes it")
    raise CheckpointError(f"step {step} not found in {manager}; steps: {_steps_text(done) or 'none finished'}")


def resolve_step(path: str | Path, step: int | None = None) -> int | None:
    """The step `load_model(path, step)` would read (None for a plain model folder): for provenance and for keying
    results, before anything is loaded."""
    found = locate(path, step)
    return None if found is None else select_step(*found)[0]


def step_saved(path: str | Path, step: int | None = None) -> int | None:
    """When the step `load_model(path, step)` would read was saved (nanoseconds: Orbax's commit timestamp in the
    step's `_CHECKPOINT_METADATA`); None for a plain model folder or a step without that file (a folder's own time
    would change with every copy). A step number is
    reused when a run is started over: results keyed on it are keyed on this too."""
    found = locate(path, step)
    if found is None:
        return None
    folder = select_step(*found)[1]  # an epath: a local folder or gs://
    try:
        stamp = json.loads((folder / "_CHECKPOINT_METADATA").read_text()).get("commit_timestamp_nsecs")
    except Exception:  # noqa: BLE001  (gs:// backends raise their own types) no metadata: not known
        return None
    return stamp if isinstance(stamp, int) else None


# ------------------------------------------------------------------------------------------------ the params tree


def _items(step_dir: Path) -> dict[str, Path]:
    """The step's PyTree items {name: folder}; "" when the step folder is itself one tree (a legacy layout)."""
    items = {c.name: c for c in sorted(step_dir.iterdir()) if c.is_dir() and (c / PYTREE_METADATA).is_file()}
    if (step_dir / PYTREE_METADATA).is_file():
        items[""] = step_dir
    if not items:
        raise CheckpointError(f"{step_dir} holds no Orbax PyTree item (no {PYTREE_METADATA} file in it or its "
                              f"subfolders); found: {sorted(c.name for c in step_dir.iterdir())[:20]}")
    return items


def _tree_metadata(item_dir: Path) -> Any:
    """An item's tree of array metadata (shape, dtype), from its metadata file: no array is read."""
    try:
        meta = ocp.PyTreeCheckpointHandler().metadata(item_dir)
    except Exception as e:  # Orbax raises many types for a damaged item
        raise CheckpointError(f"cannot read the Orbax tree metadata of {item_dir}: {_one_line(e)}") from None
    return getattr(meta, "tree", meta)


def _one_line(error: Exception) -> str:
    """An Orbax / TensorStore error (many lines, a whole spec) as a short line of a message."""
    return shorten(" ".join(str(error).split()), 300)


def _display(item: str, keys: tuple[str, ...]) -> str:
    return "/".join([item, *keys] if item else keys) or "."


def _candidates(trees: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    """Every (item, key path) whose node is a dict holding `embed_tokens`: what a decoder param tree looks like."""
    found = []

    def walk(item: str, node: Any, keys: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("embed_tokens"), dict):
                found.append((item, keys))
                return
            for k, v in node.items():
                walk(item, v, (*keys, str(k)))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(item, v, (*keys, str(i)))

    for item, tree in trees.items():
        walk(item, tree, ())
    return found


def _find_params(items: dict[str, Path], params_path: str | None,
                 where: str) -> tuple[Path, tuple[str, ...], str, Any]:
    """(item folder, key path inside it, display name, stored metadata sub-tree) of the params."""
    trees = {name: _tree_metadata(folder) for name, folder in items.items()}
    if params_path is None:
        found = _candidates(trees)
        named = [(i, k) for i, k in found if (k and k[-1] == "params") or not k]
        pick = named or found
        if not pick:
            raise CheckpointError(f"{where} holds no params tree (a dict with embed_tokens, layers_0, ...) in its "
                                  f"items {sorted(trees)}; name it with params_path='ITEM/KEY' (CLI: --params-path)")
        if len(pick) > 1:
            raise CheckpointError(f"{where} holds {len(pick)} candidate params trees: "
                                  f"{', '.join(_display(i, k) for i, k in pick)}; choose one with "
                                  "params_path=... (CLI: --params-path)")
        item, keys = pick[0]
    else:
        parts = tuple(p for p in str(params_path).strip("/").split("/") if p)
        if parts and parts[0] in trees:
            item, keys = parts[0], parts[1:]
        elif len(trees) == 1:
            item, keys = next(iter(trees)), parts
        else:
            raise CheckpointError(f"params_path {params_path!r}: {where} has no item {parts[0] if parts else ''!r}; "
                                  f"its items: {', '.join(sorted(trees))}")
    node = trees[item]
    for depth, key in enumerate(keys):
        if not isinstance(node, dict):
            kind = "a list" if isinstance(node, (list, tuple)) else "an array"
            raise CheckpointError(f"params_path {_display(item, keys)!r} in {where}: "
                                  f"{_display(item, keys[:depth])} is {kind}; only dict keys can be named")
        if key not in node:
            raise CheckpointError(f"params_path {_display(item, keys)!r} not found in {where}: "
                                  f"{_display(item, keys[:depth])} has keys {sorted(map(str, node))}")
        node = node[key]
    if not isinstance(node, dict):
        raise CheckpointError(f"params_path {_display(item, keys)!r} in {where} is not a tree of arrays")
    return items[item], tuple(keys), _display(item, keys), node


def _stored_dtype(stored: Any) -> str | None:
    """The one float dtype every stored array has, if there is one (training usually keeps float32 weights)."""
    dtypes = {str(getattr(leaf, "dtype", "")) for leaf in jax.tree.leaves(stored)}
    return dtypes.pop() if len(dtypes) == 1 and next(iter(dtypes)) in DTYPES else None


def restore_subtree(item_dir: Path, keys: tuple[str, ...], target: Any) -> Any:
    """Restore only the sub-tree at `keys` of one PyTree item, into `target` (`ShapeDtypeStruct`s with
    shardings): Orbax's partial restore leaves every other leaf (the optimizer state) unread."""
    item = target
    for key in reversed(keys):
        item = {key: item}
    args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        out = checkpointer.restore(item_dir, args=args)
    for key in keys:
        out = out[key]
    return out


# ------------------------------------------------------------------------------------------------ config


def _config_of_folder(folder: Path) -> tuple[ModelConfig, str] | None:
    """(config, file) from a parse-jax folder, a HF folder, or a parse-jax training run's run.json."""
    if (folder / CONFIG_FILE).is_file():
        return read_config(folder), CONFIG_FILE
    if (folder / "config.json").is_file():
        return read_hf_config(folder / "config.json"), "config.json"
    if (folder / RUN_FILE).is_file():
        try:
            d = json.loads((folder / RUN_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{folder / RUN_FILE} is not valid JSON: {e}") from None
        if isinstance(d, dict) and isinstance(d.get("model"), dict):
            return ModelConfig.from_dict(d["model"]), RUN_FILE
    return None


def _embedded_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """The embedded task's tokenizer, which `parse-jax train` runs use (their run folders hold no tokenizer)."""
    from parse_jax.tasks import TOKENIZER_DIR

    tok = folder_tokenizer(TOKENIZER_DIR, cfg)
    assert tok is not None
    return tok


def run_config(manager: Path, config_from: Any) -> tuple[ModelConfig, Tokenizer | None]:
    """The model config and tokenizer of a run: from `config_from` (a `Model`: its config and tokenizer; a
    `ModelConfig`; or a HF / parse-jax folder), else from the CheckpointManager folder or the run folder above it."""
    folders = [manager, manager.parent]
    if isinstance(config_from, Model):
        return config_from.config, config_from.tokenizer
    if isinstance(config_from, ModelConfig):
        cfg = config_from
        tok_dir = next((f for f in folders if (f / "tokenizer.json").is_file()), None)
        return cfg, None if tok_dir is None else folder_tokenizer(tok_dir, cfg)
    if config_from is not None:
        src = as_path(config_from)
        try:
            found = _config_of_folder(src) if src.is_dir() else None
        except ImportError as e:  # a remote path whose etils backend is not installed
            raise CheckpointError(f"cannot read config_from {src}: {e}") from None
        if found is None:
            raise ConfigError(f"config_from {src}: expected a Hugging Face folder (config.json), a parse-jax "
                              f"model folder ({CONFIG_FILE}) or a parse-jax training run ({RUN_FILE})")
        folders = [src]
    else:
        found = None
        for folder in folders:
            found = _config_of_folder(folder)
            if found is not None:
                folders = [folder]
                break
        if found is None:
            raise ConfigError(f"no model config for the checkpoints in {manager}: none of {CONFIG_FILE}, config.json "
                              f"or a parse-jax {RUN_FILE} in it or its parent; pass config_from=HF_OR_MODEL_DIR or a "
                              "ModelConfig (CLI: --config-from DIR)")
    cfg, source = found
    tokenizer = folder_tokenizer(folders[0], cfg)
    if tokenizer is None and source == RUN_FILE:
        tokenizer = _embedded_tokenizer(cfg)
    return cfg, tokenizer


# ------------------------------------------------------------------------------------------------ loading


@dataclasses.dataclass(frozen=True)
class RunStep:
    """Which params of a run `load_run` reads: the step (default: the latest finished one), the params sub-tree
    (default: found from the tree metadata) and where the config and tokenizer come from (a HF or parse-jax
    folder, a `ModelConfig`, or a `Model` whose config and tokenizer to take; default: the run folder)."""

    step: int | None = None
    params_path: str | None = None
    config_from: str | Path | ModelConfig | Model | None = None


def load_run(path: str | Path, which: RunStep = RunStep(), *, mesh: Any = None, rules: Any = None,
             fallback_replicated: bool = False, dtype: str | None = None, check_finite: bool = True,
             attention_impl: str = "xla") -> Model:
    """One step of a CheckpointManager folder as a `Model` (a `ShardedModel` on `mesh`); see the module doc.

    The model's `loaded_from` attribute says what was read: {"path", "step", "params_path"}."""
    step, params_path, config_from = which.step, which.params_path, which.config_from
    found = locate(path, step)
    if found is None:
        raise CheckpointError(f"{path} is not an Orbax CheckpointManager folder (no step subfolders)")
    manager, step = found
    step, step_dir = select_step(manager, step)
    cfg, tokenizer = run_config(manager, config_from)
    item_dir, keys, shown, stored = _find_params(_items(step_dir), params_path, f"step {step} of {manager}")
    stored_dtype = _stored_dtype(stored)
    if stored_dtype is not None and stored_dtype != cfg.dtype:
        cfg = cfg.replace(dtype=stored_dtype)  # the arrays say what was trained; `dtype=` casts afterwards
    where = f"params {shown} of step {step} in {manager}"
    problems = param_mismatches(stored, cfg)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{where} do not match the model config ({cfg.architecture}, {cfg.num_layers} layers, "
                              f"hidden {cfg.hidden_size}): {problems[0]}{more}")
    if mesh is not None:
        from parse_jax.distributed.sharded import ShardedModel
        from parse_jax.models.sharding import abstract_params, fitting_rules

        rules = rules or fitting_rules(cfg, mesh, fallback_replicated)
        target = abstract_params(cfg, mesh, rules)
    else:
        target = abstract_params_one_device(cfg)
    try:
        params = restore_subtree(item_dir, keys, target)
    except Exception as e:  # Orbax/TensorStore raise many types (some bare Exception) for damaged data
        raise CheckpointError(f"cannot restore {where}: {type(e).__name__}: {_one_line(e)}") from None
    if check_finite:
        check_finite_params(params, where)
    cfg, params = cast_params(cfg, params, dtype)
    if mesh is not None:
        model: Model = ShardedModel(cfg, params, tokenizer, attention_impl, mesh, rules)
    else:
        model = Model(cfg, params, tokenizer, attention_impl)
    model.loaded_from = {"path": str(manager), "step": step, "params_path": shown}
    return model
