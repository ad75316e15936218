"""`parse-jax` command line: generate, bench, sweep, calibrate, eval, convert, train."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

from parse_jax import __version__
from parse_jax.errors import ConfigError, InputError, ParseJaxError
from parse_jax.progress import logger, phase
from parse_jax.validation import SEED_MAX, check_float, check_int

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

PARSE_CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "parse"

# Nothing above imports jax: `parse-jax --help` builds the parser without it (commands import what they need).


def _models(args: argparse.Namespace, need_draft: bool):
    """(target, draft or None): --model/--draft folders, else the pair in --pair (default: the embedded one)."""
    from parse_jax.models.checkpoint import load_model
    from parse_jax.pair import load_pair

    check = not getattr(args, "skip_finite_check", False)
    if getattr(args, "per_host", False) and args.command != "generate":
        raise ConfigError("--per-host (each host serves its own share of the prompts) works with generate only; "
                          f"{args.command} runs one program over the whole mesh")
    _check_run_flags(args)
    _pin_steps(args)
    if args.model is None:
        if args.draft is not None:
            raise ConfigError("--draft needs --model (the target it drafts for)")
        phase(f"loading the pair {args.pair or '(embedded)'}")
        target, draft = load_pair(args.pair, dtype=args.dtype)
        _attach_eagle3(args, target)
        return _sharded(args, target), _sharded(args, draft, fallback_replicated=True)
    if args.pair is not None:
        raise ConfigError("give either --pair or --model/--draft, not both")
    mesh = getattr(args, "mesh_obj", None)  # with a mesh, Orbax restores straight into the sharded layout
    load = functools.partial(load_model, mesh=mesh, dtype=args.dtype, check_finite=check)
    phase(f"loading the target {args.model}")
    target = load(args.model, args.step, args.params_path, args.config_from)
    _attach_eagle3(args, target)
    if args.draft is None:
        if need_draft:
            raise ConfigError("this mode needs a draft model: add --draft DIR")
        return target, None
    phase(f"loading the draft {args.draft}")
    return target, load(args.draft, args.draft_step, args.draft_params_path, args.draft_config_from,
                        fallback_replicated=True)


_RUN_FLAGS = {"model": ("step", "params_path", "config_from"),
              "draft": ("draft_step", "draft_params_path", "draft_config_from")}


def _check_run_flags(args: argparse.Namespace) -> None:
    """--step/--params-path/--config-from name a step of the --target run; the --draft-* ones, of the --draft run."""
    for who, flags in _RUN_FLAGS.items():
        given = ["--" + f.replace("_", "-") for f in flags if getattr(args, f, None) is not None]
        if given and getattr(args, who) is None:
            raise ConfigError(f"{', '.join(given)}: only with --{'target' if who == 'model' else 'draft'} RUN_DIR "
                              "(a training run: an Orbax CheckpointManager folder)")


def _pin_steps(args: argparse.Namespace) -> None:
    """A training run given without --step / --draft-step: pin its latest finished step now, so that the step loaded
    and the step recorded in the provenance (and an eval results file's header) are one and the same even when the
    run saves a new step in between."""
    from parse_jax.models.checkpoint_manager import resolve_step

    for who, (step, _, _) in _RUN_FLAGS.items():
        path = getattr(args, who, None)
        if path is not None and getattr(args, step, None) is None:
            setattr(args, step, resolve_step(path))  # None for a plain model folder


def _sharded(args: argparse.Namespace, model, fallback_replicated: bool = False):
    """The model placed on --mesh (weights over `model`, requests over `data`), or as it is without a mesh."""
    mesh = getattr(args, "mesh_obj", None)
    if mesh is None:
        return model
    from parse_jax.distributed import shard_model

    return shard_model(model, mesh, fallback_replicated=fallback_replicated)


def _writer() -> bool:
    """Only process 0 of a multi-host job writes results (every process computes the same ones)."""
    from parse_jax.distributed import is_writer

    return is_writer()


def _attach_eagle3(args: argparse.Namespace, target) -> None:
    """--eagle3 DIR: the EAGLE-3 head for modes eagle3 / parse+eagle3 (checked against the target)."""
    if getattr(args, "eagle3", None) is not None:
        from parse_jax.eagle3 import load_eagle3

        target.eagle3 = load_eagle3(args.eagle3, target)


_FLAG_FIELDS = ("threshold", "max_prefixes", "rounds", "segmenter", "gamma", "max_draft_tokens", "eagle3_gamma",
                "eagle3_tree")


def _parse_config_fields(args: argparse.Namespace) -> dict:
    """ParseConfig settings of a command: the --parse-config YAML file, then each --set KEY=VALUE (in order),
    then the explicit flags (--threshold, ...): a later source overrides an earlier one. Every key must be a
    ParseConfig field and every value of that field's type (errors name the key, the value and the source)."""
    import yaml

    from parse_jax.engine import ParseConfig

    fields = {name: type(default) for name, default in ParseConfig.flat_fields().items()}
    out: dict = {}

    def put(key, value, where: str, raw: str | None = None) -> None:
        if key not in fields:
            raise ConfigError(f"{where}: unknown PARSE setting {key!r}; the settings are ParseConfig's fields: "
                              f"{', '.join(fields)}")
        kind = fields[key]
        if key == "delimiter" and isinstance(value, list):  # several delimiters: a YAML list of strings
            if not value or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{where}: delimiter must be a string or a list of non-empty strings, got {value!r}")
            value = tuple(value)
        elif kind is str:
            if raw is not None:  # --set judge_yes=Yes stays the text given (YAML would read a boolean); a quoted
                value = value if raw.strip()[:1] in ("'", '"') else raw  # value is YAML's: "\n\n" is newlines
            if not isinstance(value, str):
                raise ConfigError(f"{where}: {key} must be a string, got {value!r} (quote it in YAML)")
        elif kind is int:
            value = check_int(f"{where}: {key}", value)
        elif kind is float:
            value = check_float(f"{where}: {key}", value, *((0.0, 1.0) if key == "threshold" else ()))
        out[key] = value

    path = getattr(args, "parse_config_file", None)
    if path is not None and not Path(path).exists() and (PARSE_CONFIG_DIR / f"{path}.yaml").is_file():
        path = PARSE_CONFIG_DIR / f"{path}.yaml"  # a shipped PARSE config by name, e.g. qwen3_chat
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"cannot read --parse-config {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--parse-config {path} is not UTF-8 text") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"--parse-config {path} is not valid YAML{at}: "
                              f"{getattr(e, 'problem', None) or e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--parse-config {path} must hold a mapping of ParseConfig fields (threshold: 0.5, "
                              f"...), got {type(loaded).__name__}")
        for key, value in loaded.items():
            put(key, value, f"--parse-config {path}")
    for item in getattr(args, "set", None) or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set threshold=0.3")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        put(key.strip(), value, f"--set {item}", raw=raw)
    for key in _FLAG_FIELDS:
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    return out


def _parse_config(args: argparse.Namespace):
    from parse_jax.engine import ParseConfig

    return ParseConfig.from_flat(**_parse_config_fields(args))


def _eos_ids(args: argparse.Namespace, target=None) -> list[int] | None:
    """--eos-ids 1,2 as ints (inside the target's vocabulary once it is loaded); None when not given."""
    text = getattr(args, "eos_ids", None)
    if text is None:
        return None
    ids = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"--eos-ids must be comma-separated token ids, got {text!r}") from None
        top = None if target is None else target.config.vocab_size - 1
        ids.append(check_int("--eos-ids", value, 0, top))
    if not ids:
        raise ConfigError(f"--eos-ids must name at least one token id, got {text!r}")
    return ids


def _template_kwargs(args: argparse.Namespace) -> dict:
    return {"enable_thinking": False} if getattr(args, "no_thinking", False) else {}


def _generate(args: argparse.Namespace) -> int:
    from parse_jax.decode import generate
    from parse_jax.engine import MODES, ParseEngine

    mode = args.mode or ("target" if args.model is not None and args.draft is None else "parse")
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
    if args.no_thinking and not args.chat:
        raise ConfigError("--no-thinking applies to the chat template: add --chat")
    eos = _eos_ids(args)
    cfg = _parse_config(args)  # bad settings fail before models load (in every mode)
    target, draft = _models(args, need_draft=mode != "target")
    eos = _eos_ids(args, target)
    prompts = list(args.prompt)
    if args.chat:  # rendered by the template (which writes its own BOS), then token ids: the same in every mode
        prompts = [target.tokenizer.encode(target.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], **_template_kwargs(args))) for p in prompts]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed)
    if eos is not None:
        kw["eos_ids"] = eos
    n = len(prompts)
    if getattr(args, "per_host", False):  # each process serves its own share of the prompts
        from parse_jax.distributed import process_slice

        prompts = process_slice(prompts)
    if mode == "target":
        res = generate(target, prompts, **kw)
    else:
        res = ParseEngine(target, draft, cfg).generate(prompts, mode=mode, **kw)
    texts, tokens = res.texts, res.tokens
    if getattr(args, "per_host", False):
        from parse_jax.distributed import gather_token_lists

        tokens = gather_token_lists(res.tokens, n)
        texts = [target.tokenizer.decode(t) for t in tokens]
    if not _writer():
        return 0
    if args.json:  # one JSON object per prompt, one per line
        stats = _jsonable(res.stats)
        for prompt, text, ids in zip(list(args.prompt), texts, tokens):
            print(json.dumps({"prompt": prompt, "text": text, "tokens": [int(t) for t in ids], "stats": stats}))
    else:
        for text in texts:
            print(text)
    if args.stats:
        print(json.dumps(_jsonable(res.stats)), file=sys.stderr)
    return 0


def _jsonable(stats: dict) -> dict:
    """Stats with numpy scalars and arrays as plain numbers and lists (what json.dumps takes)."""
    return json.loads(json.dumps(stats, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def _command(args: argparse.Namespace) -> str:
    return "parse-jax " + " ".join(sys.argv[1:] if args.argv is None else args.argv)


def _model_desc(args: argparse.Namespace) -> dict:
    """Which models a result came from, for its provenance."""
    def where(path):
        return None if path is None else str(Path(path).resolve())

    desc = {"pair": where(args.pair) or ("embedded" if args.model is None else None), "target": where(args.model),
            "draft": where(args.draft), "dtype": args.dtype}
    _pin_steps(args)
    for who, (step, params_path, config_from) in _RUN_FLAGS.items():  # which step of a training run (if one)
        path, name = getattr(args, who), "target" if who == "model" else "draft"
        if path is None:
            continue
        from parse_jax.models.checkpoint_manager import resolve_step

        resolved = resolve_step(path, getattr(args, step, None))
        if resolved is not None:
            desc[f"{name}_step"] = resolved
        if getattr(args, params_path, None) is not None:
            desc[f"{name}_params_path"] = getattr(args, params_path)
        if getattr(args, config_from, None) is not None:
            desc[f"{name}_config_from"] = where(getattr(args, config_from))
    return desc


def _no_rounds(args: argparse.Namespace) -> None:
    if getattr(args, "rounds", None) is not None:
        raise ConfigError("--rounds does not apply here: the mode name sets it (parse = single round, "
                          "parse-multi = multi round)")


def _run_task(args: argparse.Namespace, target=None):
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
    from parse_jax.eval.data import load_records
    from parse_jax.eval.harness import DataTask

    records, _ = load_records(args.data, task)
    if args.n is None:
        args.n = len(records)
    elif args.n > len(records):
        raise InputError(f"--n {args.n}, but {args.data} holds {len(records)} records; give --n {len(records)} "
                         "or fewer")
    if target is None:
        return None
    return DataTask(args.data, records, target.tokenizer, task, args.chat, args.instruction, _template_kwargs(args))


DEFAULT_N = {"bench": 300, "sweep": 200, "calibrate": 200}


def _bench(args: argparse.Namespace) -> int:
    from parse_jax.atomic import check_file_writable, check_writable
    from parse_jax.bench import check_modes, run_bench, write_bench, write_json
    from parse_jax.engine import ParseEngine

    _no_rounds(args)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    modes = check_modes(names)
    if args.json is not None:  # fail before the run, not after it (and never touch an old result until done)
        check_file_writable(args.json)
    if args.out is not None:
        check_writable(args.out)
    cfg = _parse_config(args)
    _eos_ids(args)
    _run_task(args)
    target, draft = _models(args, need_draft=True)
    task = _run_task(args, target)
    eng = ParseEngine(target, draft, cfg)
    res = run_bench(eng, task, n=args.n, modes=modes, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, repeats=args.repeats, seed=args.seed,
                    progress=not args.no_progress, models=_model_desc(args), skip_unavailable="all" in names,
                    eos_ids=_eos_ids(args, target))
    res["command"] = _command(args)
    from parse_jax import compile_cache

    res["compile_cache"] = compile_cache.stats()  # hits: programs loaded from disk, misses: compiled here
    if not _writer():
        return 0
    if args.json is not None:
        print(f"wrote {write_json(res, args.json)}")
    if args.out is not None:
        for path in write_bench(res, args.out):
            print(f"wrote {path}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from parse_jax.atomic import check_writable
    from parse_jax.sweep import run_sweep, sweep_configs, sweep_table, write_sweep

    _no_rounds(args)
    values = [v for v in args.values.split(",") if v.strip()]
    base = _parse_config(args)
    sweep_configs(base, args.param, values)  # bad values fail before models load
    check_writable(args.out)
    _run_task(args)
    target, draft = _models(args, need_draft=True)
    task = _run_task(args, target)
    res = run_sweep(target, draft, base, task, args.param, values, n=args.n, mode=args.mode,
                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, repeats=args.repeats,
                    seed=args.seed, progress=not args.no_progress, models=_model_desc(args))
    res["command"] = _command(args)
    if not _writer():
        return 0
    print(sweep_table(res))
    for path in write_sweep(res, args.out):
        print(f"wrote {path}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from parse_jax.atomic import check_writable
    from parse_jax.sweep import calibrate, write_sweep

    _no_rounds(args)
    if args.threshold is not None:
        raise ConfigError("calibrate chooses the threshold: give candidates with --thresholds, not --threshold")
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    if not thresholds:
        raise ConfigError(f"--thresholds must name at least one threshold, got {args.thresholds!r}")
    for t in thresholds:
        check_float("--thresholds", t, 0.0, 1.0)
    check_float("--tolerance", args.tolerance, 0.0, 1.0, max_open=True)
    cfg = _parse_config(args)
    check_writable(args.out)
    _run_task(args)
    target, draft = _models(args, need_draft=True)
    task = _run_task(args, target)
    res = calibrate(target, draft, cfg, task, tolerance=args.tolerance,
                    thresholds=thresholds, n=args.n, mode=args.mode, seed=args.seed,
                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, repeats=args.repeats,
                    progress=not args.no_progress, models=_model_desc(args))
    res["command"] = _command(args)
    if not _writer():
        return 0
    for path in write_sweep(res, args.out, stem="calibrate", title="Threshold calibration (dev split)"):
        print(f"wrote {path}")
    chosen = res["calibration"]
    print(chosen["message"])
    if chosen["threshold"] is None:
        return 1
    print(f"threshold: {chosen['threshold']:g}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Everything is checked (settings, data, results file, models, the mode's engine) before the results file is
    written, so a start with a typo leaves nothing behind and the corrected rerun starts cleanly."""
    from parse_jax.bench import check_modes, mode_runner, provenance
    from parse_jax.eval.data import file_sha256, load_records
    from parse_jax.eval.evaluate import evaluate
    from parse_jax.eval.harness import ResultsFile, make_header, write_summary
    from parse_jax.tasks import load_task

    mode = args.mode or ("target" if args.model is not None and args.draft is None else "parse")
    if mode == "all":
        raise ConfigError("eval runs one mode; give --mode MODE")
    check_modes([mode])
    _no_rounds(args)
    if args.no_thinking and args.chat == "off":
        raise ConfigError("--no-thinking applies to the chat template; it cannot go with --chat off")
    _eos_ids(args)
    task = load_task(args.task)
    records, bad = load_records(args.data, task, args.on_bad_line)
    cfg = _parse_config(args)
    if not _writer():
        raise ConfigError("eval appends to one results file: run it as a single process (a mesh of one host's "
                          "devices is fine)")
    settings = {"mode": mode, "models": _model_desc(args), "parse_config": cfg.flat(), "task": args.task,
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
                "chat": args.chat, "instruction": args.instruction}
    if args.eos_ids is not None:  # only when given: results files of earlier versions resume as before
        settings["eos_ids"] = _eos_ids(args)
    if args.no_thinking:
        settings["enable_thinking"] = False
    header = make_header(args.data, file_sha256(args.data), settings)
    ResultsFile.check(args.out, header)  # another run's file, a folder, an unwritable place: before loading
    target, draft = _models(args, need_draft=mode not in ("target",))
    eos = _eos_ids(args, target)
    mode_runner(target, draft, cfg, mode, temperature=args.temperature, eos_ids=eos)  # the engine's own checks
    from parse_jax.eval.harness import build_prompt

    for kind in sorted({r.kind for r in records}):  # the chat template (or its absence) refuses now, not mid-run
        build_prompt(next(r for r in records if r.kind == kind), target.tokenizer, args.chat, args.instruction,
                     _template_kwargs(args))
    for b in bad:
        logger.warning(f"eval: skipping bad {b}")
    results = ResultsFile.open(args.out, header)
    res = evaluate(target, draft, records, mode, config=cfg, batch_size=args.batch_size,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, task=task,
                   chat=args.chat, instruction=args.instruction, results=results, progress=not args.no_progress,
                   log=print, eos_ids=eos, template_kwargs=_template_kwargs(args))
    summary = res.summary
    prov = provenance({**settings, "command": _command(args)}, args.seed)
    print(f"wrote {args.out} and {write_summary(results, summary, prov, bad)}")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default=None, help="folder with target/ and draft/ (default: the embedded pair)")
    p.add_argument("--model", "--target", dest="model", default=None,
                   help="target model folder (HF or Orbax, or a training run: see --step) instead of a pair")
    p.add_argument("--draft", default=None, help="draft model folder (with --model)")
    r = p.add_argument_group("training runs (Orbax CheckpointManager folders given as --target / --draft)")
    r.add_argument("--step", type=int, default=None, help="step of the --target run (default: the latest finished)")
    r.add_argument("--params-path", default=None,
                   help="params sub-tree of the --target run's checkpoints, e.g. state/params (default: found)")
    r.add_argument("--config-from", default=None,
                   help="HF or parse-jax model folder with the --target run's config and tokenizer (default: the "
                        "run folder's run.json / config files)")
    r.add_argument("--draft-step", type=int, default=None, help="step of the --draft run (default: the latest)")
    r.add_argument("--draft-params-path", default=None, help="params sub-tree of the --draft run's checkpoints")
    r.add_argument("--draft-config-from", default=None, help="config + tokenizer folder for the --draft run")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="cast the weights on load (default: the checkpoint's dtype; the embedded pair, stored in "
                        "bfloat16, loads as float32)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 head folder for the target (default: the pair's eagle3/)")
    from parse_jax.distributed_args import add_distributed_args  # no jax import while building the parser

    add_distributed_args(p)


def _parse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parse-config", dest="parse_config_file", default=None, metavar="FILE.yaml",
                   help="PARSE settings: a YAML file of ParseConfig fields (verify_suffix, judge_yes, judge_no, "
                        "delimiter, threshold, ...) or a shipped one by name (qwen3_chat); --set and the flags "
                        "below override it")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="one ParseConfig field (repeatable), the value read as a YAML scalar, e.g. --set "
                        "threshold=0.3; a text field takes the text as given, or a quoted YAML string with escapes: "
                        "--set 'delimiter=\"\\n\\n\"'; overrides --parse-config, overridden by the flags below")
    p.add_argument("--threshold", type=float, default=None, help="judge score below which a prefix is rejected")
    p.add_argument("--max-prefixes", type=int, default=None, help="prefixes verified per pass (K)")
    p.add_argument("--rounds", choices=["single", "multi"], default=None)
    p.add_argument("--segmenter", choices=["delimiter", "stride", "hybrid"], default=None)
    p.add_argument("--gamma", type=int, default=None, help="draft tokens per step in sd mode")
    p.add_argument("--max-draft-tokens", type=int, default=None)
    p.add_argument("--eagle3-gamma", type=int, default=None, help="EAGLE-3 chain length per target pass")
    p.add_argument("--eagle3-tree", type=int, default=None,
                   help="EAGLE-3 sibling leaves per target pass, chosen by draft confidence (0: chain; greedy only)")


def _eos_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eos-ids", default=None, metavar="ID,ID",
                   help="comma-separated stop token ids, replacing the model's own (e.g. 151645,151643)")


def _data_args(p: argparse.ArgumentParser) -> None:
    """--data FILE.jsonl (GSM8K-style or embedded-task records) instead of the embedded task's problems."""
    p.add_argument("--data", default=None, metavar="FILE.jsonl",
                   help="run on these records ({question, answer: '... #### N'} or {prompt}) instead of the "
                        "embedded task; accuracy is then eval's grading (the first --n records, file order)")
    p.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="with --data: GSM8K questions through the model's chat template (auto: when it has one)")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="with --data: appended to each question "
                                                                       "in chat format")
    p.add_argument("--no-thinking", action="store_true",
                   help="render the chat template with enable_thinking=False (Qwen3)")


def _convert(args: argparse.Namespace) -> int:
    from parse_jax.models.checkpoint import save_model
    from parse_jax.models.hf_import import load_hf

    phase(f"convert: reading {args.hf}")  # what convert_hf does, with a message per step
    model = load_hf(args.hf, args.dtype)
    phase(f"convert: writing {args.out}")
    out = save_model(model, args.out, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from parse_jax.train.pipeline import run_recipe
    from parse_jax.train.recipe import load_recipe

    _out_folder(args.out)
    recipe = load_recipe(args.recipe)
    _out_folder(recipe.out if args.out is None else args.out)
    res = run_recipe(recipe, out=args.out, mode=args.mode, steps=args.steps, progress=not args.no_progress,
                     grow_from=args.grow_from, quiet=args.quiet > 0)
    print(f"wrote {res['draft']} and {res['target']}")
    return 0


def _train_eagle3(args: argparse.Namespace) -> int:
    from parse_jax.tasks import load_task
    from parse_jax.train.eagle3 import Eagle3Spec, train_eagle3

    _out_folder(args.out)
    spec = Eagle3Spec(steps=args.steps, batch_size=args.batch_size, lr=args.lr, unroll=args.unroll,
                      samples=args.samples, seed=args.seed)  # bad settings fail before the target loads
    target, _ = _models(args, need_draft=False)
    train_eagle3(target, load_task(args.task), args.out, spec, mode=args.mode, progress=not args.no_progress)
    print(f"wrote {Path(args.out) / 'eagle3'} (load with pj.load_eagle3(DIR, target), or --eagle3 DIR; copy it to "
          "PAIR/eagle3 to make it the pair's default head)")
    return 0


def _out_folder(out: str | None) -> None:
    """A training --out is a run folder: refuse an existing file (or a path under one) before any work."""
    if out is None:
        return
    from parse_jax.atomic import check_writable

    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; a training run needs a folder")
    check_writable(out)


# (flag dest, kind, minimum, maximum, open minimum): the value checks every command shares (validation.py)
_CHECKS = (
    ("n", int, 1, None, False), ("max_new_tokens", int, 1, None, False), ("batch_size", int, 1, None, False),
    ("repeats", int, 1, None, False), ("seed", int, 0, SEED_MAX, False), ("top_k", int, 0, None, False),
    ("max_prefixes", int, 1, None, False), ("gamma", int, 1, None, False), ("max_draft_tokens", int, 1, None, False),
    ("eagle3_gamma", int, 1, None, False), ("eagle3_tree", int, 0, None, False), ("steps", int, 1, None, False),
    ("unroll", int, 1, None, False), ("samples", int, 1, None, False), ("step", int, 0, None, False),
    ("draft_step", int, 0, None, False), ("num_processes", int, 1, None, False), ("process_id", int, 0, None, False),
    ("threshold", float, 0.0, 1.0, False), ("temperature", float, 0.0, None, False),
    ("top_p", float, 0.0, 1.0, True), ("lr", float, 0.0, None, True),
)


def _check_args(args: argparse.Namespace) -> None:
    """Every numeric flag inside its range (NaN and inf refused), and --mesh well formed: before any work, so a
    bad value never reaches a model load or a file."""
    for dest, kind, lo, hi, open_lo in _CHECKS:
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if kind is int:
            check_int(flag, value, lo, hi)
        else:
            check_float(flag, value, lo, hi, min_open=open_lo)
    if getattr(args, "mesh", None):
        from parse_jax.distributed import parse_mesh_spec

        parse_mesh_spec(args.mesh)


# ParseConfig's defaults, shown by --help without importing the engine (and jax); tests/test_cli.py checks them
PARSE_DEFAULTS = {"threshold": 0.5, "max_prefixes": 8, "rounds": "multi", "segmenter": "delimiter", "gamma": 4,
                  "max_draft_tokens": 64, "eagle3_gamma": 5, "eagle3_tree": 0}


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Options with no help text still show their default; the PARSE options show ParseConfig's."""
    for action in p._actions:
        if action.default is None and action.dest in PARSE_DEFAULTS:
            action.help = f"{action.help or ''} (default: {PARSE_DEFAULTS[action.dest]})".strip()
        elif action.help is None and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"


class _ArgumentParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), like every other parse-jax error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every --help shows each option's default, except flags, options with no default and help that names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return text + " (default: %(default)s)"


def _output_args(p: argparse.ArgumentParser) -> None:
    """-v / -q and the compile cache: what every command takes."""
    from parse_jax.compile_cache import ENV_VAR, default_dir

    o = p.add_argument_group("messages and caching")
    o.add_argument("-v", "--verbose", action="count", default=0, help="more messages on stderr (debug)")
    o.add_argument("-q", "--quiet", action="count", default=0,
                   help="only warnings and errors on stderr, no progress bars (-qq: errors only)")
    o.add_argument("--no-compile-cache", action="store_true",
                   help=f"compile every program afresh instead of loading it from the persistent cache "
                        f"({default_dir()}; {ENV_VAR}=DIR moves it, {ENV_VAR}=0 turns it off)")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="parse-jax", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text: the target alone or with PARSE / speculative decoding")
    g.add_argument("prompt", nargs="+", help="one or more prompts (a batch)")
    _model_args(g)
    g.add_argument("--mode", default=None, help="target | sd | sequential | parse | eagle3 | parse+eagle3 (default: "
                   "parse on a pair, target with --model alone)")
    _parse_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template (any mode)")
    g.add_argument("--no-thinking", action="store_true",
                   help="with --chat: render the template with enable_thinking=False (Qwen3)")
    _eos_arg(g)
    g.add_argument("--skip-finite-check", action="store_true", help="do not check weights for NaN/inf on load")
    g.add_argument("--stats", action="store_true", help="print generation stats to stderr (one JSON object)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (prompt, text, tokens, stats), one per line, not the text")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="every mode on the same held-out problems of the embedded task, one process")
    _model_args(b)
    b.add_argument("--n", type=int, default=None,
                   help="held-out problems (default: 300; with --data: every record)")
    b.add_argument("--modes", default="all",
                   help="comma-separated bench modes, or all (every mode this pair can run): the engine's modes, "
                        "parse-multi (PARSE with rounds=multi; parse is single round) and draft (the draft alone)")
    _parse_args(b)
    b.add_argument("--task", default="default", help="embedded task preset")
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--batch-size", type=int, default=1,
                   help="requests per generate call; 1 is the regime speculation is for (README, Benchmarks)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--seed", type=int, default=0)
    _data_args(b)
    _eos_arg(b)
    b.add_argument("--json", default=None, help="write the results (docs/design.md §3 schema) here")
    b.add_argument("--out", default=None, help="folder for bench.json, bench.md and PNG plots")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_bench)

    def run_args(p: argparse.ArgumentParser, n: int) -> None:
        _model_args(p)
        _parse_args(p)
        p.add_argument("--mode", default="parse", help="the PARSE mode to vary (parse, parse-multi, sequential, ...)")
        p.add_argument("--n", type=int, default=None, help=f"problems (default: {n}; with --data: every record)")
        _data_args(p)
        p.add_argument("--task", default="default", help="embedded task preset")
        p.add_argument("--max-new-tokens", type=int, default=32)
        p.add_argument("--batch-size", type=int, default=16)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--no-progress", action="store_true")

    s = sub.add_parser("sweep", help="target once, then a PARSE mode per value of one parameter (held-out problems)")
    run_args(s, 200)
    s.add_argument("--param", required=True, choices=["threshold", "max_prefixes", "segmenter", "max_draft_tokens"])
    s.add_argument("--values", required=True,
                   help="comma-separated values; segmenter: delimiter, hybrid, stride or stride:DELTA")
    s.add_argument("--out", required=True, help="folder for sweep_PARAM.json/.md/.png and sweep_PARAM_pareto.png")
    s.set_defaults(func=_sweep)

    k = sub.add_parser("calibrate", help="the fastest threshold whose accuracy stays within a tolerance of the "
                                         "target's, on dev problems (the task's train split, never the test split)")
    run_args(k, 200)
    k.add_argument("--tolerance", type=float, default=0.01, help="allowed accuracy loss (0.01 = 1 point)")
    k.add_argument("--thresholds", default="0.05,0.1,0.2,0.3,0.5,0.7,0.8,0.9,0.95,0.99")
    k.add_argument("--out", required=True, help="folder for calibrate.json/.md/.png")
    k.set_defaults(func=_calibrate)

    e = sub.add_parser("eval", help="accuracy on a JSONL file (GSM8K-style or embedded-task records), resumable")
    e.add_argument("--data", required=True, help="JSONL: {question, answer: '... #### N'} or {prompt[, solution]}")
    _model_args(e)
    e.add_argument("--mode", default=None, help="a bench mode (default: parse on a pair, target with --model alone)")
    _parse_args(e)
    e.add_argument("--out", required=True, help="results JSONL (appended per record; rerun to resume); the summary "
                                                "goes to OUT.summary.json")
    e.add_argument("--task", default="default", help="embedded task preset that grades task records")
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--on-bad-line", choices=["error", "skip"], default="error",
                   help="a missing or malformed line: stop with the list of bad lines, or skip them (reported)")
    e.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="GSM8K questions through the model's chat template (auto: when it has one)")
    e.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each question in chat format")
    e.add_argument("--no-thinking", action="store_true",
                   help="render the chat template with enable_thinking=False (Qwen3)")
    _eos_arg(e)
    e.add_argument("--skip-finite-check", action="store_true", help="do not check weights for NaN/inf on load")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=_eval)

    c = sub.add_parser("convert", help="convert an HF folder (config.json + safetensors) to an Orbax folder")
    c.add_argument("--hf", required=True, help="HF model folder")
    c.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=_convert)

    t = sub.add_parser("train", help="train a draft/target pair from a recipe in configs/ (resumable)")
    t.add_argument("--recipe", required=True, help="recipe name (configs/NAME.yaml) or path to a YAML file")
    t.add_argument("--out", default=None, help="output folder (default: the recipe's `out`)")
    m = t.add_mutually_exclusive_group()
    m.add_argument("--resume", dest="mode", action="store_const", const="resume",
                   help="require checkpoints in --out and continue from them")
    m.add_argument("--fresh", dest="mode", action="store_const", const="fresh",
                   help="delete the checkpoints in --out and start over")
    t.set_defaults(mode="auto")
    t.add_argument("--steps", type=int, default=None, help="override every phase's step count (quick runs)")
    t.add_argument("--grow-from", default=None, metavar="MODEL_DIR",
                   help="a trained narrow target (the recipe's target_model shape) to widen instead of training "
                        "the target phase (recipes with grow.enabled)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)

    h = sub.add_parser("train-eagle3", help="train an EAGLE-3 head for a target on the embedded task (resumable)")
    _model_args(h)
    h.add_argument("--out", required=True, help="run folder: samples, checkpoints, and the head in OUT/eagle3")
    h.add_argument("--task", default="default", help="embedded task preset")
    h.add_argument("--steps", type=int, default=600)
    h.add_argument("--batch-size", type=int, default=32)
    h.add_argument("--lr", type=float, default=4e-3)
    h.add_argument("--unroll", type=int, default=4, help="training-time-test steps")
    h.add_argument("--samples", type=int, default=4000, help="train problems the target solves for the data")
    h.add_argument("--seed", type=int, default=0)
    hm = h.add_mutually_exclusive_group()
    hm.add_argument("--resume", dest="mode", action="store_const", const="resume")
    hm.add_argument("--fresh", dest="mode", action="store_const", const="fresh")
    h.set_defaults(mode="auto")
    h.add_argument("--no-progress", action="store_true")
    h.set_defaults(func=_train_eagle3)
    for choice in sub._choices_actions:  # each command's --help starts with what it does
        command = sub.choices[choice.dest]
        command.description = command.description or choice.help
    for command in sub.choices.values():
        command.formatter_class = _HelpFormatter
        _output_args(command)
        _show_defaults(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status: 0 done, 2 bad input (one line on stderr naming it), 130
    interrupted (Ctrl-C: one line, no traceback; what was finished is on disk, results written whole or not at
    all, eval's appended records intact so a rerun resumes)."""
    command = "parse-jax"
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help, --version, or a usage error (already printed as one line)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        args.argv = argv
        command = f"parse-jax {args.command}"
        from parse_jax import compile_cache, progress

        progress.configure(args.verbose - args.quiet)  # phases and diagnostics on stderr, results on stdout
        if args.quiet and hasattr(args, "no_progress"):
            args.no_progress = True
        _check_args(args)
        folder = compile_cache.cache_dir(disabled=args.no_compile_cache)
        if folder is not None:  # before the first compilation: JAX decides once per process
            compile_cache.enable(folder)
        if hasattr(args, "mesh"):  # multi-host start-up and the device mesh, before anything touches a device
            from parse_jax.distributed import initialize_from_args

            args.mesh_obj = initialize_from_args(args)
        return args.func(args)
    except ParseJaxError as e:
        print(f"{command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        print(f"{command}: interrupted", file=sys.stderr, flush=True)
        if argv is None:  # the process's own command line (console script, python -m): exit now. Finished work is
            os._exit(130)  # on disk already; interpreter teardown while XLA threads still compile can crash
        return 130


if __name__ == "__main__":
    sys.exit(main())
