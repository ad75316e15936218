"""A recipe end to end: train the draft, sample its outputs on train problems, train the target (LM + judge).

Layout of the output folder::

    draft_run/   checkpoints + run.json of the draft phase       draft/    the final draft (pj.load_model)
    draft_samples.json  the draft's sampled outputs (judge data)
    target_run/  checkpoints + run.json of the target phase      target/   the final target
    grow_run/    with `grow.enabled`: the widened target trained at full width; the narrow one is kept in
                 target_narrow/ and target/ is the wide one

Every phase resumes: a finished phase is restored from its last checkpoint and not trained again; the samples
file is reused when its fingerprint matches.
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
import numpy as np

from parse_jax.checkpoints.load import load_model
from parse_jax.checkpoints.orbax import save_model
from parse_jax.errors import CheckpointError, ConfigError, ParseJaxError
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.tasks import Task, load_task
from parse_jax.train.data import BatchStream, Encoder, RowMix
from parse_jax.train.grow import grown_config, widen_params
from parse_jax.train.recipe import ModelSpec, Recipe
from parse_jax.train.trainer import PhaseOptions, clear_outputs, train_phase
from parse_jax.utils.validation import check_int

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
SAMPLES_FILE = "draft_samples.json"


def load_tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(TOKENIZER_DIR)


def model_config(spec: ModelSpec, tokenizer: Tokenizer) -> ModelConfig:
    return spec.config(tokenizer.vocab_size, tokenizer.bos_id, (tokenizer.eos_id,))


def with_steps(recipe: Recipe, steps: int | None) -> Recipe:
    """`--steps N`: every phase runs N steps (warmup and checkpoint interval shrink to fit)."""
    if steps is None:
        return recipe

    def fit(p):
        return dataclasses.replace(p, steps=steps, warmup_steps=min(p.warmup_steps, steps // 10),
                                   checkpoint_every=min(p.checkpoint_every, steps))

    grow = dataclasses.replace(recipe.grow, phase=fit(recipe.grow.phase))
    return dataclasses.replace(recipe, draft=fit(recipe.draft), target=fit(recipe.target), grow=grow)


def params_digest(params: Any) -> str:
    """sha256 of a param tree's leaves (names, shapes, bytes): identifies a grown run's source model."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _log(msg: str, quiet: bool) -> None:
    """A phase message, on stderr with the progress bars (stdout holds the command's result)."""
    if not quiet:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sample_draft(draft: Model, task: Task, n: int, temperature: float, batch: int, seed: int,
                 max_new_tokens: int = 24, progress: bool = False) -> list[tuple[str, str]]:
    """The draft's outputs (sampled) on `n` train problems; `progress`: a bar on stderr."""
    from parse_jax.train.evaluate import solve_many

    rng = random.Random(f"samples:{seed}")
    prompts = [task.sample(rng, "train") for _ in range(n)]
    texts = solve_many(draft, task, prompts, max_new_tokens, temperature=temperature, seed=seed, batch=batch,
                       progress="sampling draft outputs" if progress else None)
    return list(zip(prompts, texts))


def _samples(out: Path, draft: Model, task: Task, recipe: Recipe, fingerprint: dict[str, Any], fresh: bool,
             quiet: bool, progress: bool = False) -> list[tuple[str, str]]:
    path = out / SAMPLES_FILE
    if path.is_file() and not fresh:
        try:
            d = json.loads(path.read_text())
            if d["fingerprint"] == fingerprint:
                _log(f"reusing {len(d['samples'])} draft samples from {path}", quiet)
                return [tuple(x) for x in d["samples"]]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            pass  # damaged or stale: sample again
    j = recipe.judge
    t0 = time.perf_counter()
    samples = sample_draft(draft, task, j.draft_samples, j.draft_temperature, j.sample_batch, recipe.target.seed,
                           progress=progress and not quiet)
    ok = sum(task.grade(p, t) for p, t in samples) / max(len(samples), 1)
    _log(f"sampled {len(samples)} draft outputs in {time.perf_counter() - t0:.1f}s "
         f"(T={j.draft_temperature}, final answers right: {ok:.1%})", quiet)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "samples": samples}))
    os.replace(tmp, path)
    return samples


def run_recipe(recipe: Recipe, out: str | Path | None = None, mode: str = "auto", steps: int | None = None,
               quiet: bool = False, progress: bool = True, grow_from: str | Path | None = None) -> dict[str, Any]:
    """Train the pair of `recipe` into `out` (default: the recipe's); returns paths and timings.

    `grow_from`: a trained narrow target (a model folder of the recipe's `target_model` shape) that takes the place
    of the target phase; the recipe must grow it (`grow.enabled`)."""
    if steps is not None:
        check_int("steps", steps, 1)
    recipe = with_steps(recipe, steps)
    if grow_from is not None and not recipe.grow.enabled:
        raise ConfigError(f"--grow-from needs a recipe that grows its target (grow.enabled); {recipe.name} does not")
    out = Path(out if out is not None else recipe.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out {out} is a file; a training run needs a folder")
    task = load_task(recipe.task)
    tok = load_tokenizer()
    enc = Encoder(tok, task)
    tcfg = model_config(recipe.target_model, tok)
    narrow = None
    if grow_from is not None:  # checked before the draft phase trains, not after
        try:
            narrow = load_model(grow_from)
        except ParseJaxError as e:
            raise type(e)(f"--grow-from {grow_from}: {e}") from None
        given, wanted = narrow.config.replace(eos_token_ids=tcfg.eos_token_ids).to_dict(), tcfg.to_dict()
        if given != wanted:
            diff = "; ".join(f"{k}: {v!r} there, {wanted[k]!r} in the recipe"
                             for k, v in given.items() if v != wanted[k])
            raise ConfigError(f"--grow-from {grow_from}: its config is not the recipe's target_model ({diff})")
    if mode == "fresh":  # the runs and the models they finished: a new draft must never meet an old target
        names = ("draft_run", "target_run", "grow_run", SAMPLES_FILE, "draft", "target_narrow", "target")
        source = None if grow_from is None else Path(grow_from).resolve()
        # --grow-from OUT/target_narrow (a rerun on the narrow target already made) is the user's input: kept
        clear_outputs(out, tuple(n for n in names if source is None or not source.is_relative_to((out / n).resolve())))
    elif mode == "resume" and not (out / "draft_run").is_dir():
        raise CheckpointError(f"nothing to resume in {out} (no draft_run/ folder)")
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    data_fp = {"task": recipe.task, "seq_len": recipe.seq_len}

    t0 = time.perf_counter()
    dcfg = model_config(recipe.draft_model, tok)
    _log(f"draft: {dcfg.num_params / 1e6:.3f}M params, {recipe.draft.steps} steps", quiet)
    dstream = BatchStream(task, enc, recipe.seq_len, recipe.draft.batch_size, recipe.draft.seed)
    dparams, _ = train_phase("draft", dcfg, recipe.draft, dstream.batch, out / "draft_run", data_fp,
                             PhaseOptions(mode="resume" if mode == "resume" else "auto", progress=progress))
    draft = Model(dcfg, dparams, tok)
    save_model(draft, out / "draft", overwrite=True)
    timings["draft_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sfp = {"draft": json.loads(json.dumps({**data_fp, "model": dcfg.to_dict(),
                                           "spec": dataclasses.asdict(recipe.draft)})),
           "judge": dataclasses.asdict(recipe.judge), "seed": recipe.target.seed}
    samples = (_samples(out, draft, task, recipe, sfp, mode == "fresh", quiet, progress)
               if recipe.judge.weight > 0 and recipe.judge.real_fraction > 0 else [])
    timings["sample_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tfp = {**data_fp, "samples": sfp, "judge": dataclasses.asdict(recipe.judge)}
    mix = RowMix(error_fraction=recipe.judge.error_fraction,
                 real_fraction=recipe.judge.real_fraction if samples else 0.0, samples=samples)
    if narrow is not None:
        tparams = narrow.params
        _log(f"target phase skipped: growing {grow_from}", quiet)
    else:
        _log(f"target: {tcfg.num_params / 1e6:.3f}M params, {recipe.target.steps} steps", quiet)
        tstream = BatchStream(task, enc, recipe.seq_len, recipe.target.batch_size, recipe.target.seed,
                              judge=recipe.judge.weight > 0, mix=mix)
        if samples:
            _log(f"real draft outputs that fit a row: {len(tstream.samples)} of {len(samples)}", quiet)
        # later phases of a resumed run start where they are: from their last checkpoint, or from the beginning
        tparams, _ = train_phase("target", tcfg, recipe.target, tstream.batch, out / "target_run", tfp,
                                 PhaseOptions(judge_weight=recipe.judge.weight, progress=progress))
    target = Model(tcfg, tparams, tok)
    timings["target_s"] = time.perf_counter() - t0
    if recipe.grow.enabled:
        save_model(target, out / "target_narrow", overwrite=True)
        t0 = time.perf_counter()
        gcfg = grown_config(tcfg, model_config(recipe.grow.model, tok))
        gp = recipe.grow.phase
        _log(f"grow: {tcfg.num_params / 1e6:.3f}M -> {gcfg.num_params / 1e6:.3f}M params, {gp.steps} steps", quiet)
        gstream = BatchStream(task, enc, recipe.seq_len, gp.batch_size, gp.seed, judge=recipe.judge.weight > 0,
                              mix=mix)
        init = widen_params(tparams, tcfg, gcfg, seed=gp.seed)
        source = {"narrow_config": tcfg.to_dict(), "params_sha256": params_digest(tparams)}  # what was widened
        gparams, _ = train_phase("grow", gcfg, gp, gstream.batch, out / "grow_run", {**tfp, "source": source},
                                 PhaseOptions(judge_weight=recipe.judge.weight, init=init, progress=progress))
        target = Model(gcfg, gparams, tok)
        timings["grow_s"] = time.perf_counter() - t0
    save_model(target, out / "target", overwrite=True)
    _log(f"wrote {out / 'draft'} and {out / 'target'} ({', '.join(f'{k} {v:.0f}' for k, v in timings.items())})",
         quiet)
    return {"draft": out / "draft", "target": out / "target", "timings": timings, "draft_model": draft,
            "target_model": target}
