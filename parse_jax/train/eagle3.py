"""Train an EAGLE-3 head for a target on the task: the target's own greedy solutions, its features and its
next-token distributions (distillation), with training-time test (the head unrolled on its own outputs).

The run is a folder: `samples.json` (the target's solutions, reused on resume), `head_run/` (the trainer's
Orbax checkpoints, fingerprinted; a killed run resumes from the last one) and, when done, `eagle3/` (the head,
loadable with `pj.load_eagle3(DIR/eagle3, target)`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from parse_jax.errors import CheckpointError, ConfigError, InputError
from parse_jax.runtime.requests import PAD_ID
from parse_jax.speculation.eagle3 import Eagle3, Eagle3Config, init_head, save_eagle3, target_taps, ttt_logits
from parse_jax.tasks import Task
from parse_jax.train.data import Encoder
from parse_jax.train.evaluate import solve_many
from parse_jax.train.forward import train_forward
from parse_jax.train.recipe import Eagle3Spec  # the head's training settings (jax-free, for the CLI)
from parse_jax.train.trainer import CKPT_DIR, PhaseOptions, clear_outputs, has_checkpoint, train_phase
from parse_jax.utils.progress import bar

SAMPLES_FILE = "samples.json"
HEAD_OUTPUTS = ("eagle3", "speculators", "d2t.npy", "t2d.npy")  # a finished head, as each trainer writes it


def target_rows(target, task: Task, spec: Eagle3Spec, folder: Path, progress: bool = True) -> np.ndarray:
    """[N, seq_len + 1] rows: prompt, the target's greedy solution, EOS, then padding; column 0 of a second array
    (returned as the last column) is the prompt length. Cached in `folder/samples.json` (keyed by the spec)."""
    path = folder / SAMPLES_FILE
    key = {"samples": spec.samples, "seed": spec.seed, "seq_len": spec.seq_len, "task": repr(task),
           "target": target_fingerprint(target)}
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            if d["key"] == key:
                return np.asarray(d["rows"], np.int32)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # damaged or stale: solve again
    enc = Encoder(target.tokenizer, task)
    rng = random.Random(f"eagle3:{spec.seed}")
    prompts = [task.sample(rng, "train") for _ in range(spec.samples)]
    t0 = time.perf_counter()
    texts = solve_many(target, task, prompts, max_new_tokens=spec.seq_len, batch=256,
                       progress="target solving train problems" if progress else None)
    eos = target.tokenizer.eos_id
    rows = np.full((len(prompts), spec.seq_len + 1), PAD_ID, np.int32)
    lengths, whole = [], []
    for i, (p, text) in enumerate(zip(prompts, texts)):
        ids = enc.prompt_ids(p)
        sol = target.tokenizer.encode(text) + ([eos] if eos is not None else [])
        row = (ids + sol)[: spec.seq_len]
        rows[i, : len(row)] = row
        rows[i, -1] = len(ids)
        lengths.append(len(row))
        whole.append(len(ids) + len(sol))
    check_trainable(rows[:, -1], np.asarray(lengths), spec.seq_len, max(whole))
    if progress:
        print(f"target solved {len(prompts)} train problems in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
              flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "rows": rows.tolist()}))
    os.replace(tmp, path)
    return rows


MAX_TEACHER_BYTES = 4 << 30


def check_trainable(prompt_lens: np.ndarray, row_lens: np.ndarray, seq_len: int, fits: int) -> None:
    """Refuse rows in which no response token follows a context token: the head would have nothing to predict
    and train to a loss of 0 on nothing. `fits`: the --seq-len that holds the longest row whole."""
    targets = np.maximum(np.asarray(row_lens) - np.maximum(np.asarray(prompt_lens), 1), 0)
    if int(targets.sum()) <= 0:
        raise InputError(f"--seq-len {seq_len}: no row keeps a response token after its prompt, so the head would "
                         f"train on nothing; raise --seq-len (--seq-len {fits} fits every row whole)")


def target_fingerprint(target) -> str:
    """The target's identity in run fingerprints: a digest of each param's name, shape, dtype and a strided sample of
    its values (16 to 31 per axis), read to the host. The same weights give it on any mesh (a sum on the devices
    did not: its order follows the sharding, and a run could not resume on another mesh); a few KB move."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(target.params)[0]:
        sample = x[tuple(slice(None, None, max(1, n // 16)) for n in x.shape)]
        h.update(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}".encode())
        h.update(np.ascontiguousarray(jax.device_get(sample)).tobytes())
    return h.hexdigest()


def teacher_arrays(target, cfg: Eagle3Config, rows: np.ndarray, batch: int = 256,
                   progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The target's taps [N, T, 3d] and next-token distributions [N, T, V] on `rows`, computed once (the target is
    frozen, so every training step would recompute the same numbers). Sized for small vocabularies: a large one is
    refused up front instead of running out of memory."""
    tokens = rows[:, :-1]
    n, t = tokens.shape
    size = n * t * (3 * cfg.layer.hidden_size + cfg.layer.vocab_size) * 4
    if size > MAX_TEACHER_BYTES:
        raise ConfigError(f"EAGLE-3 training keeps the target's features and distributions for {n} samples x {t} "
                          f"tokens in memory: {size / 2**30:.1f} GiB for vocabulary {cfg.layer.vocab_size} and width "
                          f"{cfg.layer.hidden_size}, over the {MAX_TEACHER_BYTES / 2**30:.0f} GiB limit; use fewer "
                          "--samples")

    @jax.jit
    def run(ids):
        logits, hiddens = train_forward(target.params, target.config, ids)
        return target_taps(hiddens, cfg.taps), jax.nn.softmax(logits, axis=-1)

    feats, teacher = [], []
    with bar(len(tokens), "teacher pass (target features and distributions)", enabled=progress,
             unit="row") as pbar:
        for i in range(0, len(tokens), batch):
            chunk = tokens[i: i + batch]
            pad = batch - len(chunk)
            f, p = run(np.concatenate([chunk, np.zeros((pad, chunk.shape[1]), np.int32)]) if pad else chunk)
            feats.append(np.asarray(f)[: len(chunk)])
            teacher.append(np.asarray(p)[: len(chunk)])
            pbar.update(len(chunk))
    return np.concatenate(feats), np.concatenate(teacher)


def make_loss(target, cfg: Eagle3Config, spec: Eagle3Spec):
    """`loss(head_params, batch) -> (loss, metrics)`: soft cross-entropy to the target's distribution at every
    solution position, for each unroll step, weighted by step_decay ** k; also each step's top-1 agreement."""
    target_cfg, target_params = target.config, target.params

    def loss(head_params, batch):
        tokens, prompt_len, teacher = batch["tokens"], batch["prompt_len"], batch["teacher"]
        t = tokens.shape[1]
        # real tokens: the rows' own lengths when given (id 0 is a real token of most vocabularies), else non-padding
        real = (jnp.arange(t)[None] < batch["length"][:, None]) if "length" in batch else tokens != PAD_ID
        steps = ttt_logits(head_params, cfg, target_params, target_cfg, tokens, batch["features"], spec.unroll)
        total, metrics, weight_sum = 0.0, {}, 0.0
        for k, head_logits in enumerate(steps):
            u = jnp.arange(t) + 1 + k  # the target position whose distribution step k predicts, per t
            u_c = jnp.minimum(u, t - 1)
            nxt = jnp.minimum(u + 1, t - 1)
            # valid: the token after u is a real solution token
            valid = (u + 1 < t)[None] & ((u + 1)[None] >= prompt_len[:, None]) & real[:, nxt]
            target_p = teacher[:, u_c]
            ce = optax.softmax_cross_entropy(head_logits, target_p)
            n = jnp.maximum(valid.sum(), 1)
            step_loss = (ce * valid).sum() / n
            agree = ((jnp.argmax(head_logits, -1) == jnp.argmax(target_p, -1)) * valid).sum() / n
            w = spec.step_decay ** k
            total, weight_sum = total + w * step_loss, weight_sum + w
            metrics[f"acc{k}"] = agree
        return total / weight_sum, metrics

    return loss


def train_eagle3(target, task: Task, out: str | Path, spec: Eagle3Spec | None = None, mode: str = "auto",
                 progress: bool = True, on_step=None) -> Eagle3:
    """Train (or resume) a head for `target` into `out`; returns it, also saved in `out/eagle3/`."""
    spec = spec or Eagle3Spec()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"EAGLE-3 training: out {out} is a file; a training run needs a folder")
    cfg = Eagle3Config.for_target(target.config)
    if mode == "resume" and not has_checkpoint(out / "head_run"):  # before the teacher pass, and no samples.json
        raise CheckpointError(f"nothing to resume in {out}: no checkpoint in {out / 'head_run' / CKPT_DIR}")
    rows = target_rows(target, task, spec, out, progress)
    n = len(rows)

    feats, teacher = teacher_arrays(target, cfg, rows, progress=progress)

    def batch_fn(step: int) -> dict[str, np.ndarray]:
        idx = np.random.default_rng([spec.seed, step]).integers(0, n, spec.batch_size)
        return {"tokens": rows[idx, :-1], "prompt_len": rows[idx, -1], "features": feats[idx],
                "teacher": teacher[idx]}

    fingerprint: dict[str, Any] = {"eagle3": cfg.to_dict(), "eagle3_spec": dataclasses.asdict(spec),
                                   "target_params": target_fingerprint(target)}
    options = PhaseOptions(mode=mode, init=init_head(cfg, spec.seed), loss=make_loss(target, cfg, spec),
                           on_step=on_step, progress=progress)
    if mode == "fresh":  # an earlier run's finished head goes with its checkpoints (train_phase removes those)
        clear_outputs(out, HEAD_OUTPUTS)
    params, _ = train_phase("eagle3", cfg.layer, spec.phase(), batch_fn, out / "head_run", fingerprint, options)
    head = Eagle3(cfg, jax.device_get(params))
    save_eagle3(head, out / "eagle3", overwrite=True)
    return head
