"""The commands: each takes the parsed flags and returns the exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from parse_jax.cli.setup import (
    check_out_folder,
    command_line,
    eos_ids_from_args,
    jsonable,
    model_desc,
    models_from_args,
    models_saved,
    no_rounds,
    parse_config,
    run_settings,
    run_task,
    template_kwargs,
    writes_results,
)
from parse_jax.errors import ConfigError, InputError
from parse_jax.utils.progress import logger, phase
from parse_jax.utils.validation import check_float, check_int, check_text


def cmd_generate(args: argparse.Namespace) -> int:
    from parse_jax.engine import MODES, ParseEngine
    from parse_jax.runtime.decode import generate

    mode = args.mode or ("target" if args.model is not None and args.draft is None else "parse")
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
    if args.no_thinking and not args.chat:
        raise ConfigError("--no-thinking applies to the chat template: add --chat")
    eos = eos_ids_from_args(args)
    cfg = parse_config(args)  # bad settings fail before models load (in every mode)
    prompts = list(args.prompt)
    for i, p in enumerate(prompts):  # blank or non-UTF-8 text fails here, also before a chat template wraps it
        check_text(f"prompt {i}", p)
    from parse_jax.modes.table import MODE_TABLE

    target, draft = models_from_args(args, need_draft=MODE_TABLE[mode].needs_draft,
                                     uses_draft=MODE_TABLE[mode].needs_draft)
    eos = eos_ids_from_args(args, target)
    if args.chat:  # rendered by the template (which writes its own BOS), then token ids: the same in every mode
        prompts = [target.tokenizer.encode(target.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], **template_kwargs(args))) for p in prompts]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed)
    if eos is not None:
        kw["eos_ids"] = eos
    n = len(prompts)
    if getattr(args, "per_host", False):  # each process serves its own share of the prompts
        from parse_jax.distributed.multihost import process_slice

        prompts = process_slice(prompts)
    engine = ParseEngine(target, draft, cfg)
    if mode == "target":  # plain decoding outside the engine: the memory check `engine.generate` makes itself
        from parse_jax.lowering.run import check_memory

        check_memory(engine, prompts, mode, args.max_new_tokens)  # a run that cannot fit: one line, nothing allocated
        res = generate(target, prompts, **kw)
    else:
        res = engine.generate(prompts, mode=mode, **kw)
    texts, tokens = res.texts, res.tokens
    if getattr(args, "per_host", False):
        from parse_jax.distributed.multihost import gather_token_lists

        tokens = gather_token_lists(res.tokens, n)
        texts = [target.tokenizer.decode(t) for t in tokens]
    if not writes_results():
        return 0
    if args.json:  # one JSON object per prompt, one per line; the prompts ran as one call, whose stats each carries
        stats = jsonable(res.stats)
        for prompt, text, ids in zip(list(args.prompt), texts, tokens):
            print(json.dumps({"prompt": prompt, "text": text, "tokens": [int(t) for t in ids],
                              "new_tokens": len(ids), "stats": stats}))
    else:
        for text in texts:
            print(text)
    if args.stats:
        print(json.dumps(jsonable(res.stats)), file=sys.stderr)
    return 0



def cmd_bench(args: argparse.Namespace) -> int:
    from parse_jax.engine import ParseEngine
    from parse_jax.harness.bench import run_bench, write_bench
    from parse_jax.harness.runs import check_modes, needs_draft, write_json
    from parse_jax.utils.atomic import check_file_writable, check_writable

    no_rounds(args)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    modes = check_modes(names)
    if args.json is not None:  # fail before the run, not after it (and never touch an old result until done)
        check_file_writable(args.json)
    if args.out is not None:
        check_writable(args.out)
    cfg = parse_config(args)
    eos_ids_from_args(args)
    run_task(args)
    target, draft = models_from_args(args, need_draft=needs_draft(names),
                                     uses_draft="all" in names or needs_draft(names))
    task = run_task(args, target)
    eng = ParseEngine(target, draft, cfg)
    settings = run_settings(args, eos_ids=eos_ids_from_args(args, target))
    res = run_bench(eng, task, settings, modes=modes, models=model_desc(args), skip_unavailable="all" in names)
    res["command"] = command_line(args)
    from parse_jax.runtime import executables
    from parse_jax.utils import compile_cache

    res["compile_cache"] = compile_cache.stats()  # hits: programs loaded from disk, misses: compiled here
    res["executables"] = executables.stats()  # loads: programs loaded untraced (runtime/executables), compiles: here
    if not writes_results():
        return 0
    if args.json is not None:
        print(f"wrote {write_json(res, args.json)}")
    if args.out is not None:
        for path in write_bench(res, args.out):
            print(f"wrote {path}")
    return 0



def cmd_sweep(args: argparse.Namespace) -> int:
    from parse_jax.engine import ParseEngine
    from parse_jax.harness.sweep import check_sweep_mode, run_sweep, sweep_configs, sweep_table, write_sweep
    from parse_jax.utils.atomic import check_writable

    no_rounds(args)
    check_sweep_mode(args.mode)  # before the models load
    values = [v for v in args.values.split(",") if v.strip()]
    base = parse_config(args)
    sweep_configs(base, args.param, values)  # bad values fail before models load
    eos_ids_from_args(args)
    check_writable(args.out)
    run_task(args)
    target, draft = models_from_args(args, need_draft=True)
    task = run_task(args, target)
    settings = run_settings(args, eos_ids=eos_ids_from_args(args, target))
    res = run_sweep(ParseEngine(target, draft, base), task, args.param, values, settings, mode=args.mode,
                    models=model_desc(args))
    res["command"] = command_line(args)
    if not writes_results():
        return 0
    print(sweep_table(res))
    for path in write_sweep(res, args.out):
        print(f"wrote {path}")
    return 0



def cmd_calibrate(args: argparse.Namespace) -> int:
    from parse_jax.engine import ParseEngine
    from parse_jax.harness.runs import mode_config
    from parse_jax.harness.sweep import CALIBRATED_CONFIG, calibrate, check_sweep_mode, write_sweep
    from parse_jax.modes.table import MODE_TABLE
    from parse_jax.utils.atomic import check_writable

    no_rounds(args)
    check_sweep_mode(args.mode)  # before the models load
    if args.threshold is not None:
        raise ConfigError("calibrate chooses the threshold: give candidates with --thresholds, not --threshold")
    given = [item for item in args.set or [] if item.partition("=")[0].strip() == "threshold"]
    if given:  # a --parse-config file's threshold is that file's default, which calibrate replaces
        raise ConfigError(f"calibrate chooses the threshold: give candidates with --thresholds, not --set {given[0]}")
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    if not thresholds:
        raise ConfigError(f"--thresholds must name at least one threshold, got {args.thresholds!r}")
    for t in thresholds:
        check_float("--thresholds", t, 0.0, 1.0)
    check_float("--tolerance", args.tolerance, 0.0, 1.0, max_open=True)
    cfg = parse_config(args)
    eos_ids_from_args(args)
    check_writable(args.out)
    run_task(args)
    target, draft = models_from_args(args, need_draft=True)
    task = run_task(args, target)
    settings = run_settings(args, eos_ids=eos_ids_from_args(args, target))
    res = calibrate(ParseEngine(target, draft, cfg), task, settings, tolerance=args.tolerance,
                    thresholds=thresholds, mode=args.mode, models=model_desc(args))
    res["command"] = command_line(args)
    if not writes_results():
        return 0
    for path in write_sweep(res, args.out, stem="calibrate", title="Threshold calibration (dev split)"):
        print(f"wrote {path}")
    chosen = res["calibration"]
    print(chosen["message"])
    if chosen["threshold"] is None:
        stale = Path(args.out) / CALIBRATED_CONFIG
        given = [Path(args.parse_config_file).resolve()] if args.parse_config_file else []
        if stale.is_file() and stale.resolve() not in given:  # an earlier calibration's (never this run's input)
            stale.unlink()
            print(f"removed {stale}: an earlier calibration's settings, not this run's")
        return 1
    print(f"threshold: {chosen['threshold']:g}")
    # the calibrated settings, for every command (--parse-config) and ParseConfig.load
    ran, engine_mode = mode_config(cfg, args.mode)
    rounds = f"{ran.rounds} round, " if MODE_TABLE[engine_mode].honours_rounds else ""
    how = (f"threshold {chosen['threshold']:g}: chosen by parse-jax calibrate on {res['n']} dev problems with mode "
           f"{args.mode} ({rounds}schedule fixed, batch {res['batch_size']});\nthe other settings are "
           f"as given (schedule {cfg.schedule}, rounds {cfg.rounds})")
    path = dataclasses.replace(cfg, threshold=chosen["threshold"]).save(Path(args.out) / CALIBRATED_CONFIG,
                                                                        comment=how)
    print(f"wrote {path}: run with --parse-config {path}")
    return 0



def cmd_eval(args: argparse.Namespace) -> int:
    """Everything is checked (settings, data, results file, models, the mode's engine) before the results file is
    written, so a start with a typo leaves nothing behind and the corrected rerun starts cleanly."""
    from parse_jax.harness.eval.data import file_sha256, load_records
    from parse_jax.harness.eval.evaluate import evaluate_checked
    from parse_jax.harness.eval.results import PER_RECORD_DRAWS, ResultsFile, make_header, write_summary
    from parse_jax.harness.provenance import provenance
    from parse_jax.harness.runs import check_modes, mode_runner, needs_draft
    from parse_jax.tasks import load_task

    mode = args.mode or ("target" if args.model is not None and args.draft is None else "parse")
    if mode == "all":
        raise ConfigError("eval runs one mode; give --mode MODE")
    check_modes([mode])
    from parse_jax.modes.table import MODE_TABLE

    if args.rounds is not None and any(mode == spec.multi_label for spec in MODE_TABLE.values()):
        raise ConfigError(f"--rounds does not apply to --mode {mode}: the mode name sets it (multi round); "
                          f"--rounds applies to --mode {mode.removesuffix('-multi')}")
    if args.no_thinking and args.chat == "off":
        raise ConfigError("--no-thinking applies to the chat template; it cannot go with --chat off")
    eos_ids_from_args(args)
    task = load_task(args.task)
    limit = None if args.limit is None else check_int("--limit", args.limit, 1)  # lm-eval's: the first N records
    records, bad = load_records(args.data, task, args.on_bad_line, limit=limit)  # nothing past them is read
    cfg = parse_config(args)
    if not writes_results():
        raise ConfigError("eval appends to one results file: run it as a single process (a mesh of one host's "
                          "devices is fine)")
    settings = {"mode": mode, "models": model_desc(args), "parse_config": cfg.flat(), "task": args.task,
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed,
                "chat": args.chat, "instruction": args.instruction, "batching": args.batching}
    if args.eos_ids is not None:  # only when given: results files of earlier versions resume as before
        settings["eos_ids"] = eos_ids_from_args(args)
    if args.no_thinking:
        settings["enable_thinking"] = False
    if args.temperature > 0:  # each record draws from its own seed (earlier versions' draws depended on the batch)
        settings["draws"] = PER_RECORD_DRAWS
    saved = models_saved(args)
    if saved:  # only for training-run steps: results files of model folders resume as before
        settings["models_saved"] = saved
    header = make_header(args.data, file_sha256(args.data), settings)
    ResultsFile.check(args.out, header)  # another run's file, a folder, an unwritable place: before loading
    target, draft = models_from_args(args, need_draft=needs_draft([mode]), uses_draft=needs_draft([mode]))
    eos = eos_ids_from_args(args, target)
    runner = mode_runner(target, draft, cfg, mode, temperature=args.temperature, eos_ids=eos, honour_rounds=True)
    from parse_jax.harness.eval.results import PromptFormat, check_records
    from parse_jax.harness.runs import RunSettings

    run = RunSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                      temperature=args.temperature, eos_ids=eos, progress=not args.no_progress,
                      batching=args.batching)
    prompt_format = PromptFormat(args.chat, args.instruction, template_kwargs(args))
    records, unfit = check_records(records, runner.check, run, tokenizer=target.tokenizer,  # every request, now
                                   prompt_format=prompt_format, on_bad_line=args.on_bad_line, where=args.data)
    bad = sorted([*bad, *unfit], key=lambda b: b.line)
    for b in bad:
        logger.warning(f"eval: skipping bad {b}")
    results = ResultsFile.open(args.out, header)
    # what pj.evaluate runs past its checks, with this runner (one engine: its warnings once)
    res = evaluate_checked(runner, records, run, tokenizer=target.tokenizer, task=task, prompt_format=prompt_format,
                           results=results, log=print)
    summary = res.summary
    prov = provenance({**settings, "command": command_line(args)}, args.seed)
    print(f"wrote {args.out} and {write_summary(results, summary, prov, bad)}")
    return 0



def cmd_convert(args: argparse.Namespace) -> int:
    from parse_jax.checkpoints.hf import load_hf
    from parse_jax.checkpoints.orbax import check_save_path, save_model

    check_save_path(args.out, args.overwrite)  # before a tensor is read
    phase(f"convert: reading {args.hf}")  # what convert_hf does, with a message per step
    model = load_hf(args.hf, args.dtype)
    phase(f"convert: writing {args.out}")
    out = save_model(model, args.out, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0



def cmd_export(args: argparse.Namespace) -> int:
    """A model parse-jax loads (a HF folder, a parse-jax checkpoint, a training run's step) as a HF folder."""
    from parse_jax.checkpoints.hf import export_hf
    from parse_jax.checkpoints.load import load_model
    from parse_jax.checkpoints.save_path import check_save_path
    from parse_jax.cli.setup import check_run_flags, flags_named

    check_run_flags(args)
    if Path(args.model).resolve().is_relative_to(Path(args.out).resolve()):  # --overwrite would delete the source
        raise ConfigError(f"--out {args.out} holds --model {args.model}: the export replaces that folder whole; "
                          "choose another --out")
    check_save_path(args.out, args.overwrite)  # before a tensor is read
    phase(f"export: reading {args.model}")
    with flags_named("model"):
        model = load_model(args.model, args.step, args.params_path, args.config_from)
    phase(f"export: writing {args.out}")
    print(f"wrote {export_hf(model, args.out, dtype=args.dtype, overwrite=args.overwrite)}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from parse_jax.train.pipeline import run_recipe
    from parse_jax.train.recipe import load_recipe

    check_out_folder(args.out)
    recipe = load_recipe(args.recipe)
    check_out_folder(recipe.out if args.out is None else args.out)
    res = run_recipe(recipe, out=args.out, mode=args.mode, steps=args.steps, progress=not args.no_progress,
                     grow_from=args.grow_from, quiet=args.quiet > 0)
    print(f"wrote {res['draft']} and {res['target']}")
    return 0



def cmd_train_eagle3(args: argparse.Namespace) -> int:
    from parse_jax.tasks import load_task
    from parse_jax.train.eagle3 import Eagle3Spec, train_eagle3

    check_out_folder(args.out)
    spec = Eagle3Spec(steps=args.steps, batch_size=args.batch_size, lr=args.lr, unroll=args.unroll,
                      samples=args.samples, seq_len=args.seq_len, seed=args.seed,
                      draft_vocab_size=args.draft_vocab_size)  # bad settings fail before the target loads
    if args.data is None and (args.regenerate or args.draft_vocab_size):
        raise ConfigError("--regenerate and --draft-vocab-size train on a dataset: add --data FILE.jsonl")
    if args.data is not None and not Path(args.data).is_file():
        raise InputError(f"--data: file not found: {args.data}")
    target, _ = models_from_args(args, need_draft=False, uses_draft=False)
    if args.data is not None:
        from parse_jax.train.eagle3_data import train_eagle3_data
        from parse_jax.train.trainer import PhaseOptions

        train_eagle3_data(target, args.data, args.out, spec, regenerate=args.regenerate,
                          run=PhaseOptions(mode=args.mode, progress=not args.no_progress),
                          verifier=args.verifier or _verifier_of(args.model))
        extra = f" and {Path(args.out) / 'speculators'} (the speculators format, for vLLM)"
    else:
        train_eagle3(target, load_task(args.task), args.out, spec, mode=args.mode, progress=not args.no_progress)
        extra = ""
    print(f"wrote {Path(args.out) / 'eagle3'}{extra} (load with pj.load_eagle3(DIR, target), or --eagle3 DIR; "
          "copy it to PAIR/eagle3 to make it the pair's default head)")
    return 0


def _verifier_of(model: str | None) -> str | None:
    """What OUT/speculators names as its verifier by default: the --model folder as an absolute path (the path as
    typed means nothing outside this working directory), else the name as given."""
    return str(Path(model).absolute()) if model is not None and Path(model).is_dir() else model
