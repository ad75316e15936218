"""Orbax CheckpointManager folders written the way a user's training loop writes them, for loader and eval tests."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from parse_jax.models.model import Model


def write_run(folder: Path, model: Model, steps=(100, 200), extra=None, handler=None,
              run_json: bool = False, naming: dict | None = None) -> dict[int, dict]:
    """AdamW from `model.params` towards another random model of the same shapes (so steps are different models,
    none degenerate), the user's own CheckpointManager in `folder` saving
    {params, opt_state} (plus `extra(params)` entries) as item `state` and a JSON item `meta` at each of `steps`.
    `run_json`: lay it out as this project's trainer does (folder/ckpt + folder/run.json with the config).
    `naming`: CheckpointManagerOptions' step naming (`step_prefix`, `step_format_fixed_length`).
    Returns {step: params saved (numpy)}."""
    manager_dir = (folder / "ckpt" if run_json else folder).absolute()
    opt = optax.adamw(3e-3)
    params = jax.tree.map(jnp.asarray, model.params)
    opt_state = opt.init(params)
    rng = np.random.default_rng(len(jax.tree.leaves(params)))
    goal = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, np.std(x) + 0.05, x.shape).astype(x.dtype)), params)

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(lambda p: sum(jnp.sum((x - g) ** 2) for x, g in zip(jax.tree.leaves(p),
                                                                           jax.tree.leaves(goal))))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    saved = {}
    opts = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False, **(naming or {}))
    handlers = {"state": handler} if handler is not None else None
    with ocp.CheckpointManager(manager_dir, options=opts, item_names=("state", "meta"),
                               item_handlers=handlers) as mngr:
        for step in range(1, max(steps) + 1):
            params, opt_state = train_step(params, opt_state)
            if step in steps:
                state = {"params": params, "opt_state": opt_state, **(extra(params) if extra else {})}
                save = ocp.args.PyTreeSave(state) if handler is not None else ocp.args.StandardSave(state)
                mngr.save(step, args=ocp.args.Composite(state=save, meta=ocp.args.JsonSave({"step": step})))
                saved[step] = jax.tree.map(np.asarray, params)
        mngr.wait_until_finished()
    if run_json:
        (folder / "run.json").write_text(json.dumps({"phase": "test", "task": "default",
                                                     "model": model.config.to_dict()}))
    return saved
