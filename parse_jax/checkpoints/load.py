"""The one loader: `load_model(path, step=, mesh=)` tells a Hugging Face folder, a parse-jax (Orbax) checkpoint and
a training run (an Orbax CheckpointManager folder) apart by their files, and restores onto a mesh when one is given
(each device reads only its slices).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from parse_jax.checkpoints import runs as checkpoint_manager
from parse_jax.checkpoints.hf import INDEX_FILE, SINGLE_FILE, check_vocab, load_hf
from parse_jax.checkpoints.orbax import CONFIG_FILE, PARAMS_DIR, load_orbax, restore_params, save_model
from parse_jax.distributed.mesh import check_mesh
from parse_jax.distributed.sharded import ShardedModel, shard_model
from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model
from parse_jax.models.sharding import ShardingRules, abstract_params, fitting_rules
from parse_jax.models.tokenizer import Tokenizer


def _remote_model_folder_message(path: Any) -> str:
    """Why a remote path that is no training run cannot load."""
    return (f"{path} is not an Orbax CheckpointManager folder: remote paths are read for training runs only; copy a "
            "model folder to a local path")


def load_model(path: str | Path, step: int | None = None, params_path: str | None = None,
               config_from: str | Path | ModelConfig | Model | None = None, mesh: Any = None, *,
               dtype: str | None = None, check_finite: bool = True, attention_impl: str = "xla",
               fallback_replicated: bool = False) -> Model:
    """Load a HF model folder, a parse-jax checkpoint, or one step of an Orbax `CheckpointManager` folder (a
    training run: told apart by their files), optionally cast to `dtype`.

    `step`, `params_path`, `config_from`: which step (default: the latest finished one), which params sub-tree
    (default: found from the tree metadata) and where the config + tokenizer come from (a HF or parse-jax folder,
    a `ModelConfig`, or a `Model` whose config and tokenizer to take; default: the run folder);
    see `parse_jax.checkpoints.runs`. `mesh`: restore straight into the sharded layout
    (`parse_jax.checkpoints.load.load_sharded`); `fallback_replicated` then replicates a model the mesh cannot split."""
    from parse_jax.checkpoints import runs as checkpoint_manager

    check_mesh(mesh)
    remote = checkpoint_manager.is_remote(path)  # gs://...: a run, read through etils.epath as Orbax reads it
    if not remote:
        path = Path(path).absolute()  # Orbax reads metadata only through absolute paths
        if not path.exists():
            raise CheckpointError(f"model path not found: {path}")
        if not path.is_dir():
            raise CheckpointError(f"model path must be a folder, got a file: {path}")
    if checkpoint_manager.locate(path, step) is not None:
        return checkpoint_manager.load_run(path, checkpoint_manager.RunStep(step, params_path, config_from),
                                           mesh=mesh, dtype=dtype, check_finite=check_finite,
                                           attention_impl=attention_impl, fallback_replicated=fallback_replicated)
    if remote:
        raise CheckpointError(_remote_model_folder_message(path))
    given = [name for name, value in (("step", step), ("params_path", params_path), ("config_from", config_from))
             if value is not None]
    if given and ((path / CONFIG_FILE).is_file() or (path / "config.json").is_file()):
        raise CheckpointError(f"{path} is a model folder, not an Orbax CheckpointManager folder (step subfolders): "
                              f"drop {', '.join(given)}")
    if mesh is not None:
        from parse_jax.checkpoints.load import load_sharded

        return load_sharded(path, mesh, dtype=dtype, check_finite=check_finite, attention_impl=attention_impl,
                            fallback_replicated=fallback_replicated)
    if (path / CONFIG_FILE).is_file():
        return load_orbax(path, dtype, check_finite, attention_impl)
    if (path / "config.json").is_file():
        return load_hf(path, dtype, check_finite, attention_impl)
    found = sorted(p.name for p in path.iterdir())[:20]
    raise CheckpointError(
        f"{path} is not a model folder: expected either a Hugging Face folder (config.json, {SINGLE_FILE} or "
        f"{INDEX_FILE}, tokenizer.json) or a parse-jax checkpoint ({CONFIG_FILE}, {PARAMS_DIR}/), or an Orbax "
        f"CheckpointManager folder (step subfolders such as 1000/, or a run folder with ckpt/); "
        f"found: {found or 'an empty folder'}")



def convert_hf(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False, dtype: str | None = None) -> Path:
    """HF folder -> parse-jax checkpoint (loads, checks, saves); returns the checkpoint path."""
    return save_model(load_hf(hf_dir, dtype), out_dir, overwrite=overwrite)


def restore_sharded_params(folder: str | Path, cfg: ModelConfig, mesh: Mesh,
                           rules: ShardingRules | None = None) -> dict[str, Any]:
    """Orbax restore of a parse-jax checkpoint's params straight into their sharded layout: the target is an
    abstract tree of `ShapeDtypeStruct`s with NamedShardings, so each device reads only its own slices, whatever
    device count or layout wrote the checkpoint."""
    return restore_params(Path(folder), cfg, abstract_params(cfg, mesh, rules))



def load_sharded(path: str | Path, mesh: Mesh, rules: ShardingRules | None = None, dtype: str | None = None,
                 check_finite: bool = True, attention_impl: str = "xla",
                 fallback_replicated: bool = False, step: int | None = None, params_path: str | None = None,
                 config_from: Any = None) -> ShardedModel:
    """`pj.load_model` onto a mesh. A parse-jax (Orbax) checkpoint, or a step of an Orbax CheckpointManager folder
    (`step`, `params_path`, `config_from`: see `checkpoints.runs.load_run`), is restored shard by shard, never
    whole on one device; so is a Hugging Face folder (each device reads its slices of the safetensors files,
    `checkpoints.hf.load_hf_sharded`). `rules` default: `fitting_rules(config, mesh, fallback_replicated)`."""
    check_mesh(mesh, needed_by="load_sharded (pj.load_model(path) loads onto one device)")
    path = path if checkpoint_manager.is_remote(path) else Path(path).absolute()  # gs://...: as etils reads it
    if checkpoint_manager.locate(path, step) is not None:
        return checkpoint_manager.load_run(path, checkpoint_manager.RunStep(step, params_path, config_from),
                                           mesh=mesh, rules=rules, fallback_replicated=fallback_replicated,
                                           dtype=dtype, check_finite=check_finite, attention_impl=attention_impl)
    if checkpoint_manager.is_remote(path):
        raise CheckpointError(_remote_model_folder_message(path))
    if not (path / CONFIG_FILE).is_file() and (path / "config.json").is_file():
        from parse_jax.checkpoints.hf import load_hf_sharded

        return load_hf_sharded(path, mesh, rules, dtype=dtype, check_finite=check_finite,
                               attention_impl=attention_impl, fallback_replicated=fallback_replicated)
    if not (path / CONFIG_FILE).is_file():
        model = load_model(path, dtype=dtype, check_finite=check_finite, attention_impl=attention_impl)
        return shard_model(model, mesh, rules, fallback_replicated)
    try:
        d = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path / CONFIG_FILE} is not valid JSON: {e}") from None
    cfg = ModelConfig.from_dict(d)
    rules = rules or fitting_rules(cfg, mesh, fallback_replicated)
    params = restore_sharded_params(path, cfg, mesh, rules)
    if check_finite:
        bad = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
               if not bool(jnp.isfinite(x).all())]
        if bad:
            raise CheckpointError(f"checkpoint {path} has non-finite values (inf/nan) in: {', '.join(bad)}")
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)  # elementwise: keeps each sharding
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(path)
        check_vocab(tokenizer, cfg)
    return ShardedModel(cfg, params, tokenizer, attention_impl, mesh, rules)
