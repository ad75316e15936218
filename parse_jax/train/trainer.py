"""One optimisation phase: AdamW + warmup/cosine + clipping, a jitted donated train step, Orbax checkpoints with
resume, and a tqdm bar with loss and tokens/s.

Checkpoints live in ``<dir>/ckpt/<step>/`` (Orbax `CheckpointManager`: written into a temporary folder and renamed
when complete, so a kill never leaves a half checkpoint under a step name; the last `keep_checkpoints` are kept).
Each holds the params, the optimizer state, and JSON metadata: step, the data stream's RNG state (its seed and
the step, since batch `step` depends only on them) and the run's fingerprint. ``<dir>/run.json`` holds the
fingerprint too; resuming under a different fingerprint (another model shape, recipe or step count) is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import init_params
from parse_jax.train.forward import train_logits
from parse_jax.train.recipe import PhaseSpec
from parse_jax.utils.validation import check_choice

RUN_FILE = "run.json"


class TrainingError(ConfigError):
    """A run whose loss or params became NaN/inf: the settings (learning rate, data) cannot train this model."""

CKPT_DIR = "ckpt"


def make_optimizer(spec: PhaseSpec) -> optax.GradientTransformation:
    warmup = min(spec.warmup_steps, max(spec.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=spec.lr, warmup_steps=warmup, decay_steps=max(spec.steps, warmup + 1),
        end_value=spec.lr * spec.final_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(spec.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=spec.weight_decay))


def loss_fn(params, cfg: ModelConfig, batch: dict[str, jax.Array], judge_weight: float):
    """Mean cross-entropy over LM-masked targets + judge_weight * mean over judge-masked targets."""
    logits = train_logits(params, cfg, batch["tokens"], batch["positions"], batch["limit"], batch["group"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    lm_n = jnp.maximum(batch["lm_mask"].sum(), 1.0)
    judge_n = jnp.maximum(batch["judge_mask"].sum(), 1.0)
    lm = (ce * batch["lm_mask"]).sum() / lm_n
    judge = (ce * batch["judge_mask"]).sum() / judge_n
    return lm + judge_weight * judge, (lm, judge)


def make_train_step(cfg: ModelConfig, opt: optax.GradientTransformation, judge_weight: float,
                    loss: Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]] | None = None):
    """A jitted donated AdamW step. `loss(params, batch) -> (loss, metrics)` replaces the decoder's LM + judge loss
    (the EAGLE-3 head trains through this same loop)."""
    if loss is None:
        def loss(params, batch):
            total, (lm, judge) = loss_fn(params, cfg, batch, judge_weight)
            return total, {"lm": lm, "judge": judge}

    def step(params, opt_state, batch):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": value, **metrics, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0, 1))


def _manager(folder: Path, keep: int) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(folder.absolute() / CKPT_DIR, options=opts, item_names=("state", "meta"))


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: checkpoint has {b!r}, this run has {a!r}"]


def check_fingerprint(folder: Path, fingerprint: dict[str, Any]) -> None:
    """Refuse to resume a run folder written under another config."""
    run_file = folder / RUN_FILE
    try:
        stored = json.loads(run_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has checkpoints but no {RUN_FILE}: not a parse-jax training run") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{run_file} is corrupt: {e}") from None
    diffs = _diff(fingerprint, stored)
    if diffs:
        raise CheckpointError(f"cannot resume {folder}: its checkpoints come from another config ("
                              + "; ".join(diffs[:6]) + (" ..." if len(diffs) > 6 else "")
                              + "); use --fresh to start over or another --out")


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _check_finite(name: str, step: int, metrics: dict[str, float], params: Any, spec: PhaseSpec) -> None:
    """Stop at the first logged step whose loss or params are NaN/inf: such a run must never write a checkpoint or
    a model (the last good checkpoint stays the latest)."""
    bad = [k for k in ("loss", "grad_norm") if k in metrics and not np.isfinite(metrics[k])]
    if not bad and not bool(jax.tree.reduce(lambda a, b: a & b,
                                            jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), params))):
        bad = ["params"]
    if bad:
        shown = ", ".join(f"{k} {metrics[k]}" if k in metrics else "non-finite params" for k in bad)
        raise TrainingError(f"training {name} diverged at step {step} ({shown}) with lr {spec.lr:g}: nothing was "
                            "saved for this step; lower the learning rate (or raise warmup) and rerun")


@dataclasses.dataclass(frozen=True)
class PhaseOptions:
    """How `train_phase` runs, beside what it trains. `mode`: "auto" resumes when checkpoints exist, "resume"
    requires one, "fresh" deletes the run folder first. `judge_weight`: of the judge-token loss. `init`: params to
    start from instead of a random init (fine-tuning; name its origin in the fingerprint). `loss`: see
    `make_train_step`. `on_step(step)`: called after each finished step (tests use it to simulate a crash).
    `progress`: a bar on stderr."""

    mode: str = "auto"
    judge_weight: float = 0.0
    init: dict[str, Any] | None = None
    loss: Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]] | None = None
    on_step: Callable[[int], None] | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ("auto", "resume", "fresh"))


def clear_outputs(out: Path, names: tuple[str, ...]) -> None:
    """`--fresh`: remove what an earlier run wrote in `out` under `names` (its checkpoints, and the finished models
    it saved), so that nothing of it is loaded beside the new run's."""
    for name in names:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def has_checkpoint(folder: str | Path) -> bool:
    """Whether the run folder of a phase holds a checkpoint to resume from."""
    ckpt = Path(folder) / CKPT_DIR
    return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def train_phase(name: str, cfg: ModelConfig, spec: PhaseSpec, batch_fn: Callable[[int], dict[str, np.ndarray]],
                folder: str | Path, fingerprint: dict[str, Any], options: PhaseOptions = PhaseOptions(),
                ) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Train `cfg` for `spec.steps` steps on `batch_fn(step)`, as `options` say; returns (params, per-step metrics
    of this process)."""
    mode, judge_weight, init, loss = options.mode, options.judge_weight, options.init, options.loss
    on_step, progress = options.on_step, options.progress
    folder = Path(folder)
    fingerprint = {"phase": name, "model": cfg.to_dict(), "spec": dataclasses.asdict(spec), **fingerprint}
    fingerprint = json.loads(json.dumps(fingerprint))
    if mode == "fresh" and folder.exists():
        shutil.rmtree(folder)
    opt = make_optimizer(spec)
    has_ckpt = has_checkpoint(folder)
    if mode == "resume" and not has_ckpt:
        raise CheckpointError(f"no checkpoint to resume in {folder / CKPT_DIR}")
    if has_ckpt:
        check_fingerprint(folder, fingerprint)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(folder / RUN_FILE, fingerprint)
    mngr = _manager(folder, spec.keep_checkpoints)
    start = 0
    params = init_params(cfg, spec.seed) if init is None else jax.tree.map(jnp.array, init)
    opt_state = opt.init(params)
    if has_ckpt:
        latest = mngr.latest_step()
        if latest is None:
            raise CheckpointError(f"no complete checkpoint in {folder / CKPT_DIR}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        try:
            restored = mngr.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # Orbax/TensorStore raise many types for damaged data
            raise CheckpointError(f"checkpoint {folder / CKPT_DIR / str(latest)} is missing or corrupt: "
                                  f"{type(e).__name__}: {str(e)[:300]}") from None
        meta = restored["meta"]
        if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint or meta.get("step") != latest:
            raise CheckpointError(f"checkpoint {folder / CKPT_DIR / str(latest)} has metadata that does not "
                                  "match this run (corrupt, or written by another config)")
        params, opt_state = restored["state"]["params"], restored["state"]["opt_state"]
        start = latest
    step_fn = make_train_step(cfg, opt, judge_weight, loss)
    history: list[dict[str, float]] = []
    bar = tqdm(total=spec.steps, initial=start, desc=name, disable=not progress, dynamic_ncols=True,
               mininterval=1.0)
    t_last, tokens_since = time.perf_counter(), 0
    try:
        for step in range(start, spec.steps):
            batch = batch_fn(step)
            tokens_since += int((batch["tokens"] != 0).sum())
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            done = step + 1
            if done % spec.checkpoint_every == 0 or done == spec.steps or done % 25 == 0 or step == start:
                metrics = {k: float(v) for k, v in metrics.items()}
                _check_finite(name, done, metrics, params, spec)
                history.append({"step": done, **metrics})
                now = time.perf_counter()
                shown = {k: f"{v:.4f}" if k == "loss" else f"{v:.3f}" for k, v in metrics.items() if k != "grad_norm"}
                bar.set_postfix(**shown, tok_s=f"{tokens_since / (now - t_last):.0f}")
                t_last, tokens_since = now, 0
            bar.update(1)
            if done % spec.checkpoint_every == 0 or done == spec.steps:
                meta = {"step": done, "fingerprint": fingerprint,
                        "data_rng": {"seed": spec.seed, "next_batch": done}}
                mngr.save(done, args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                    meta=ocp.args.JsonSave(meta)))
                mngr.wait_until_finished()
            if on_step is not None:
                on_step(done)
    finally:
        bar.close()
        mngr.wait_until_finished()
        mngr.close()
    return params, history


def latest_step(folder: str | Path) -> int | None:
    folder = Path(folder) / CKPT_DIR
    if not folder.is_dir():
        return None
    steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit()]
    return max(steps) if steps else None


def restore_params(folder: str | Path, cfg: ModelConfig, spec: PhaseSpec, step: int | None = None) -> dict[str, Any]:
    """The params of checkpoint `step` (default: the latest) of a run folder, e.g. to evaluate a run in flight."""
    folder = Path(folder)
    step = latest_step(folder) if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {folder / CKPT_DIR}")
    params = init_params(cfg, spec.seed)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            {"params": params, "opt_state": make_optimizer(spec).init(params)})
    mngr = _manager(folder, spec.keep_checkpoints)
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    except Exception as e:
        raise CheckpointError(f"checkpoint {folder / CKPT_DIR / str(step)} is missing or corrupt: {e}") from None
    finally:
        mngr.close()
    return restored["state"]["params"]
