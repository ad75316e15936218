"""What a command builds from its flags: the models (a pair, folders or training runs, on a mesh), the PARSE
settings, stop ids, the task or data, provenance of the models.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import sys
from pathlib import Path

from parse_jax.errors import ConfigError, InputError, ParseJaxError
from parse_jax.utils.progress import logger, phase
from parse_jax.utils.validation import check_int


def models_from_args(args: argparse.Namespace, need_draft: bool, *, uses_draft: bool = True):
    """(target, draft or None): --model/--draft folders, else the pair in --pair (default: the embedded one).
    `need_draft`: refuse a run without a draft; `uses_draft=False`: the run has no use for one, so a --draft given
    is not loaded (a pair folder loads both)."""
    from parse_jax.checkpoints.load import load_model
    from parse_jax.checkpoints.pair import load_pair

    check = not getattr(args, "skip_finite_check", False)
    if getattr(args, "per_host", False) and args.command != "generate":
        raise ConfigError("--per-host (each host serves its own share of the prompts) works with generate only; "
                          f"{args.command} runs one program over the whole mesh")
    check_run_flags(args)
    pin_steps(args)
    if args.model is None:
        if args.draft is not None:
            raise ConfigError("--draft needs --model (the target it drafts for)")
        phase(f"loading the pair {args.pair or '(embedded)'}")
        target, draft = load_pair(args.pair, dtype=args.dtype)
        attach_eagle3(args, target)
        return place_on_mesh(args, target), place_on_mesh(args, draft, fallback_replicated=True)
    if args.pair is not None:
        raise ConfigError("give either --pair or --model/--draft, not both")
    mesh = getattr(args, "mesh_obj", None)  # with a mesh, Orbax restores straight into the sharded layout
    load = functools.partial(load_model, mesh=mesh, dtype=args.dtype, check_finite=check)
    phase(f"loading the target {args.model}")
    with flags_named("model"):
        target = load(args.model, args.step, args.params_path, args.config_from)
    attach_eagle3(args, target)
    if args.draft is None:
        if need_draft:
            raise ConfigError("this mode needs a draft model: add --draft DIR")
        return target, None
    if not uses_draft:
        phase(f"not loading the draft {args.draft}: this run uses none")
        return target, None
    phase(f"loading the draft {args.draft}")
    with flags_named("draft"):
        draft = load(args.draft, args.draft_step, args.draft_params_path, args.draft_config_from,
                     fallback_replicated=True)
    return target, draft


DRAFT_FLAGS = re.compile(r"(?<![\w-])--(step|params-path|config-from)\b")  # as the target's flags are named
LOADER_ARGS = "step|params_path|config_from"  # `load_model`'s arguments that are run flags on the command line


@contextlib.contextmanager
def flags_named(who: str):
    """A loader's errors inside, with its argument names as the flags of `who`'s run ("model": `--step`, ...;
    "draft": `--draft-step`, ...): one place, for every command that loads a run's step."""
    try:
        yield
    except ParseJaxError as e:
        raise type(e)(as_flags(str(e), who)) from None


def as_flags(message: str, who: str) -> str:
    """A loader's error with its argument names (`drop step`, `params_path '...'`, `step=3`) as the command line's
    flags of `who`'s run (`--step`; for "draft" `--draft-step`, the target's flags it names renamed too)."""
    prefix = "" if who == "model" else "draft-"
    if prefix:  # the loader names the target's flags; a draft run has its own
        message = DRAFT_FLAGS.sub(lambda m: "--draft-" + m.group(1), message)

    def flag(name: str) -> str:
        return f"--{prefix}{name.replace('_', '-')}"

    message = re.sub(rf"drop ((?:{LOADER_ARGS})(?:, (?:{LOADER_ARGS}))*)$",
                     lambda m: "drop " + ", ".join(flag(n) for n in m.group(1).split(", ")), message)
    message = re.sub(r"^(params_path|config_from) ", lambda m: flag(m.group(1)) + " ", message)
    # a step asked for that is missing or unfinished (a step pinned as the latest is neither): name its flag
    message = re.sub(r"^step (\d+) (?=not found|in .* is still being written)",
                     lambda m: f"{flag('step')} {m.group(1)}: step {m.group(1)} ", message)
    return re.sub(r"\bstep=(\d+)", lambda m: f"{flag('step')} {m.group(1)}", message)



RUN_FLAGS = {"model": ("step", "params_path", "config_from"),
              "draft": ("draft_step", "draft_params_path", "draft_config_from")}



def given_runs(args: argparse.Namespace):
    """(who, name, path, its step flags' attribute names) of the --target and --draft given: "model" / "target",
    "draft" / "draft"."""
    for who, flags in RUN_FLAGS.items():
        path = getattr(args, who, None)
        if path is not None:
            yield who, "target" if who == "model" else "draft", path, flags


def check_run_flags(args: argparse.Namespace) -> None:
    """--step/--params-path/--config-from name a step of the --target run; the --draft-* ones, of the --draft run."""
    for who, flags in RUN_FLAGS.items():
        given = ["--" + f.replace("_", "-") for f in flags if getattr(args, f, None) is not None]
        if given and getattr(args, who) is None:
            raise ConfigError(f"{', '.join(given)}: only with --{'target' if who == 'model' else 'draft'} RUN_DIR "
                              "(a training run: an Orbax CheckpointManager folder)")



def pin_steps(args: argparse.Namespace) -> None:
    """A training run given without --step / --draft-step: pin its latest finished step now, so that the step loaded
    and the step recorded in the provenance (and an eval results file's header) are one and the same even when the
    run saves a new step in between."""
    from parse_jax.checkpoints.runs import resolve_step

    for who, (step, _, _) in RUN_FLAGS.items():
        path = getattr(args, who, None)
        if path is not None and getattr(args, step, None) is None:
            setattr(args, step, resolve_step(path))  # None for a plain model folder



def place_on_mesh(args: argparse.Namespace, model, fallback_replicated: bool = False):
    """The model placed on --mesh (weights over `model`, requests over `data`), or as it is without a mesh."""
    mesh = getattr(args, "mesh_obj", None)
    if mesh is None:
        return model
    from parse_jax.distributed.sharded import shard_model

    return shard_model(model, mesh, fallback_replicated=fallback_replicated)



def writes_results() -> bool:
    """Only process 0 of a multi-host job writes results (every process computes the same ones)."""
    from parse_jax.distributed.multihost import is_writer

    return is_writer()



def attach_eagle3(args: argparse.Namespace, target) -> None:
    """--eagle3 DIR: the EAGLE-3 head for modes eagle3 / parse+eagle3 (checked against the target)."""
    if getattr(args, "eagle3", None) is not None:
        from parse_jax.speculation.eagle3 import load_eagle3

        target.eagle3 = load_eagle3(args.eagle3, target)



def parse_config_fields(args: argparse.Namespace) -> dict:
    """ParseConfig settings of a command: --parse-config (a shipped name, a YAML/JSON file or inline JSON, read by
    `ParseConfig.load`'s reader), then each --set KEY=VALUE (in order), then the explicit flags (--threshold, ...):
    a later source overrides an earlier one. Every key must be a ParseConfig field and every value of that field's
    type (errors name the key, the value and the source)."""
    from parse_jax.settings import ParseConfig, read_set_item, read_source

    out: dict = {}
    source = getattr(args, "parse_config_file", None)
    if source is not None:
        inline = source.lstrip().startswith("{")
        out.update(read_source(source, "--parse-config JSON" if inline else f"--parse-config {source}"))
    for item in getattr(args, "set", None) or []:
        key, value = read_set_item(item)
        out[key] = value
    for key in ParseConfig.flat_fields():  # the flags (--threshold, ...) are named as the settings they set
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    return out



def parse_config(args: argparse.Namespace):
    from parse_jax.settings import ParseConfig

    return ParseConfig.from_flat(**parse_config_fields(args))



def eos_ids_from_args(args: argparse.Namespace, target=None) -> list[int] | None:
    """--eos-ids 1,2 as ints (inside the target's vocabulary once it is loaded); `none`: [] (no stop id, every row
    writes its whole budget); None when not given."""
    text = getattr(args, "eos_ids", None)
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    ids = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"--eos-ids must be comma-separated token ids (or none), got {text!r}") from None
        top = None if target is None else target.config.vocab_size - 1
        ids.append(check_int("--eos-ids", value, 0, top))
    if not ids:
        raise ConfigError(f"--eos-ids must name at least one token id (or none), got {text!r}")
    return ids



def template_kwargs(args: argparse.Namespace) -> dict:
    return {"enable_thinking": False} if getattr(args, "no_thinking", False) else {}



def jsonable(stats: dict) -> dict:
    """Stats with numpy scalars and arrays as plain numbers and lists (what json.dumps takes)."""
    return json.loads(json.dumps(stats, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))



def command_line(args: argparse.Namespace) -> str:
    return "parse-jax " + " ".join(sys.argv[1:] if args.argv is None else args.argv)



def model_desc(args: argparse.Namespace) -> dict:
    """Which models a result came from, for its provenance."""
    from parse_jax.checkpoints.runs import resolve_step, shown_path

    desc = {"pair": shown_path(args.pair) or ("embedded" if args.model is None else None),
            "target": shown_path(args.model), "draft": shown_path(args.draft), "dtype": args.dtype}

    pin_steps(args)
    for who, name, path, (step, params_path, config_from) in given_runs(args):  # which step of a run (if one)
        with flags_named(who):  # the first look at the run (eval's header): its errors name the flags too
            resolved = resolve_step(path, getattr(args, step, None))
        if resolved is not None:
            desc[f"{name}_step"] = resolved
        if getattr(args, params_path, None) is not None:
            desc[f"{name}_params_path"] = getattr(args, params_path)
        if getattr(args, config_from, None) is not None:
            desc[f"{name}_config_from"] = shown_path(getattr(args, config_from))
    return desc



def models_saved(args: argparse.Namespace) -> dict:
    """When each training-run step the flags name was saved ({"target": ns, "draft": ns}; empty for model folders):
    a results file keyed on a step number alone would resume on other weights saved under the same number."""
    from parse_jax.checkpoints.runs import step_saved

    pin_steps(args)
    saved = {name: step_saved(path, getattr(args, step, None)) for _, name, path, (step, _, _) in given_runs(args)}
    return {name: stamp for name, stamp in saved.items() if stamp is not None}


def no_rounds(args: argparse.Namespace) -> None:
    if getattr(args, "rounds", None) is not None:
        raise ConfigError("--rounds does not apply here: the mode name sets it (parse = single round, "
                          "parse-multi = multi round)")



def run_task(args: argparse.Namespace, target=None):
    """The problems of bench / sweep / calibrate: the embedded task, or the records of --data (graded as eval
    grades them). Without `target` only the file is checked (before the models load)."""
    from parse_jax.tasks import load_task

    task = load_task(args.task)
    if getattr(args, "data", None) is None:
        if args.no_thinking or args.chat != "auto":
            raise ConfigError("--chat and --no-thinking apply to --data records")
        if args.n is None:
            args.n = DEFAULT_N[args.command]
        return task
    from parse_jax.harness.eval.data import load_records
    from parse_jax.harness.eval.results import DataTask

    records, bad = load_records(args.data, task, args.on_bad_line)
    if target is None:  # the first call, before the models load
        for b in bad:
            logger.warning(f"{args.command}: skipping bad {b}")
    if args.n is None:
        args.n = len(records)
    elif args.n > len(records):
        raise InputError(f"--n {args.n}, but {args.data} holds {len(records)} records; give --n {len(records)} "
                         "or fewer")
    if target is None:
        return None
    return DataTask(args.data, records, target.tokenizer, task, args.chat, args.instruction, template_kwargs(args),
                    on_bad_line=args.on_bad_line)



DEFAULT_N = {"bench": 300, "sweep": 200, "calibrate": 200}



def check_out_folder(out: str | None) -> None:
    """A training --out is a run folder: refuse an existing file (or a path under one) before any work."""
    if out is None:
        return
    if not str(out).strip():  # Path("") is the current folder: a run would land among whatever is there
        raise ConfigError(f"--out {out!r} is empty; give the run's folder")
    from parse_jax.utils.atomic import check_writable

    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; a training run needs a folder")
    check_writable(out)


def run_settings(args: argparse.Namespace, **extra):
    """The shared run settings (harness.runs.RunSettings) of bench, sweep and calibrate from their flags."""
    from parse_jax.harness.runs import RunSettings

    return RunSettings(n=args.n, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                       repeats=args.repeats, seed=args.seed, progress=not args.no_progress, batching=args.batching,
                       **extra)
