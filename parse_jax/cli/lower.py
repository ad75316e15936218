"""`parse-jax lower`: every program a run would compile, lowered for a TPU or a GPU chip from this machine, written
serialized with a report (programs, shapes, custom calls, memory plan). Models are read as shapes only (config and
tokenizer), so an 8B pair is lowered on a laptop without its weights."""

from __future__ import annotations

import argparse
import json

from parse_jax.errors import ConfigError
from parse_jax.utils.progress import phase

PLATFORMS = ("tpu", "cuda")
LOWER_MODES = ("target", "sd", "sequential", "parse", "parse-single", "parse-multi", "eagle3", "parse+eagle3",
               "prefix_scores", "all")
ALL_MODES = LOWER_MODES[:-1]


def _models(args: argparse.Namespace):
    from parse_jax.lowering.sources import check_shape_pair, read_head_shapes, shape_head, shape_model, shape_pair

    if args.model is None:
        if args.draft is not None:
            raise ConfigError("--draft needs --model (the target it drafts for)")
        target, draft = shape_pair(args.pair, args.dtype)
    else:
        if args.pair is not None:
            raise ConfigError("give either --pair or --model/--draft, not both")
        target = shape_model(args.model, args.dtype)
        draft = shape_model(args.draft, args.dtype) if args.draft is not None else None
    if draft is not None:
        check_shape_pair(target, draft)
    target.eagle3 = shape_head(target.config) if args.eagle3 is None else read_head_shapes(args.eagle3, target)
    return target, draft


def cmd_lower(args: argparse.Namespace) -> int:
    from parse_jax.cli.setup import parse_config
    from parse_jax.engine import ParseEngine
    from parse_jax.lowering.chips import chip
    from parse_jax.lowering.export import check_lowered_folder, write_lowered
    from parse_jax.lowering.run import LowerTarget, lower_run

    if args.out is not None and args.memory_only:
        raise ConfigError("--out writes lowered programs: drop --memory-only, or --out")
    if args.out is not None:
        check_lowered_folder(args.out)  # before any lowering, not after it
    device = chip(args.chip, args.platform)  # --chip h100 alone lowers for cuda
    cfg = parse_config(args)
    target, draft = _models(args)
    modes = ALL_MODES if args.mode == "all" else (args.mode,)
    needs_draft = [m for m in modes if m not in ("target", "eagle3", "prefix_scores")]
    if draft is None and needs_draft:
        raise ConfigError(f"mode {needs_draft[0]} needs a draft: add --draft (or lower --mode target)")
    engine = ParseEngine(target, draft, cfg)
    programs, reports = {}, []  # programs by name: under --mode all, parse's are parse-multi's and parse-single's
    for mode in modes:
        phase(f"{'planning' if args.memory_only else 'lowering'} {mode} for {device.platform} {device.name}")
        run = lower_run(engine, mode, args.batch_size, args.max_new_tokens, prompt_len=args.prompt_len,
                        target=LowerTarget(device.platform, device.name, args.lower_mesh, args.attention_impl),
                        lower=not args.memory_only)
        for p in run.programs:
            programs.setdefault(p.name, p)  # written once each
        reports.append(run.report())
        for p in run.programs:
            if p.ok:
                calls = ", ".join(f"{k} x{v}" for k, v in p.custom_calls.items()) or "no custom calls"
                print(f"{p.name}: lowered in {p.seconds:.1f} s ({calls})")
            else:
                print(f"{p.name}: NOT lowered: {p.error}")
        print(f"memory ({mode}): {run.memory.line()}")
    report = {"command": "parse-jax lower", "runs": reports}
    if args.out is not None:
        write_lowered(args.out, list(programs.values()), report)
        done = sum(p.ok for p in programs.values())
        print(f"wrote {done} program{'s' if done != 1 else ''} and report.json to {args.out}")
    if args.json:
        print(json.dumps(report, indent=1))
    return 0 if all(p.ok for p in programs.values()) else 1


def add_lower_command(sub, add_parse_args) -> None:
    p = sub.add_parser("lower", help="lower a run's programs for a TPU or GPU chip from this machine, with a "
                                     "memory plan (no accelerator, no model weights needed; an --eagle3 head's are "
                                     "read for its check)")
    p.add_argument("--pair", default=None, help="folder with target/ and draft/ (default: the embedded pair)")
    p.add_argument("--model", "--target", dest="model", default=None,
                   help="target: a model folder (HF or parse-jax; only its config and tokenizer are read), a "
                        "config.json, or a shipped config by name (qwen3-8b, qwen3-0.6b, llama3-8b, llama3-1b)")
    p.add_argument("--draft", default=None, help="draft, as --model")
    p.add_argument("--eagle3", default=None, metavar="DIR",
                   help="EAGLE-3 head folder for the target, in any layout pj.load_eagle3 reads (default: a head "
                        "with the target's default taps and full vocabulary, as shapes)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the weights' dtype (default: the config's)")
    p.add_argument("--platform", choices=PLATFORMS, default=None,
                   help="what to lower for (default: --chip's platform, else tpu)")
    p.add_argument("--chip", default=None, help="v4, v5e, v5p, v6e (tpu) or h100, h200 (cuda); default v5e / h100")
    p.add_argument("--mesh", dest="lower_mesh", default=None, metavar="data=D,model=M",
                   help="an abstract mesh of such chips, e.g. data=2,model=4 (default: one chip)")
    p.add_argument("--mode", choices=LOWER_MODES, default="parse",
                   help="the run to lower (parse follows --rounds; all: every mode)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per batch")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--attention-impl", choices=["pallas", "xla"], default="pallas",
                   help="pallas: the platform's kernel (Mosaic on TPU, Triton on CUDA); xla: dense attention")
    add_parse_args(p)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the serialized programs (NAME.jax_exported, NAME.mlir) and report.json here")
    p.add_argument("--memory-only", action="store_true",
                   help="the memory plan alone, at once: no program is traced or lowered")
    p.add_argument("--json", action="store_true", help="also print the report as JSON")
    p.set_defaults(func=cmd_lower)
