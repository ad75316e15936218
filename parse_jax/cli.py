"""`parse-jax` command line: generate, bench, convert, train."""

from __future__ import annotations

import argparse
import sys

from parse_jax.errors import ConfigError, ParseJaxError


def _models(args: argparse.Namespace, need_draft: bool):
    """(target, draft or None): --model/--draft folders, else the pair in --pair (default: the embedded one)."""
    from parse_jax.models.checkpoint import load_model
    from parse_jax.pair import load_pair

    check = not getattr(args, "skip_finite_check", False)
    if args.model is None:
        if args.draft is not None:
            raise ConfigError("--draft needs --model (the target it drafts for)")
        return load_pair(args.pair, dtype=args.dtype)
    if args.pair is not None:
        raise ConfigError("give either --pair or --model/--draft, not both")
    target = load_model(args.model, dtype=args.dtype, check_finite=check)
    if args.draft is None:
        if need_draft:
            raise ConfigError("this mode needs a draft model: add --draft DIR")
        return target, None
    return target, load_model(args.draft, dtype=args.dtype, check_finite=check)


def _parse_config(args: argparse.Namespace):
    from parse_jax.engine import ParseConfig

    kw = {k: getattr(args, k) for k in ("threshold", "max_prefixes", "rounds", "segmenter", "gamma",
                                         "max_draft_tokens") if getattr(args, k, None) is not None}
    return ParseConfig(**kw)


def _generate(args: argparse.Namespace) -> int:
    from parse_jax.decode import generate
    from parse_jax.engine import MODES, ParseEngine

    mode = args.mode or ("target" if args.model is not None and args.draft is None else "parse")
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
    target, draft = _models(args, need_draft=mode != "target")
    prompts = list(args.prompt)
    if args.chat:
        prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed)
    if mode == "target":
        res = generate(target, prompts, add_bos=not args.chat, **kw)
    else:
        if args.chat:
            raise ConfigError("--chat works with --mode target only")
        res = ParseEngine(target, draft, _parse_config(args)).generate(prompts, mode=mode, **kw)
    for text in res.texts:
        print(text)
    if args.stats:
        print(res.stats, file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from parse_jax.bench import check_modes, run_bench, write_json
    from parse_jax.engine import ParseEngine
    from parse_jax.tasks import load_task

    modes = check_modes([m.strip() for m in args.modes.split(",") if m.strip()])
    if args.json is not None:  # fail before the run, not after it
        write_json({"status": "running"}, args.json)
    target, draft = _models(args, need_draft=True)
    eng = ParseEngine(target, draft, _parse_config(args))
    res = run_bench(eng, load_task(args.task), n=args.n, modes=modes, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, repeats=args.repeats, seed=args.seed,
                    progress=not args.no_progress)
    res["command"] = "parse-jax " + " ".join(sys.argv[1:] if args.argv is None else args.argv)
    if args.json is not None:
        print(f"wrote {write_json(res, args.json)}")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default=None, help="folder with target/ and draft/ (default: the embedded pair)")
    p.add_argument("--model", default=None, help="target model folder (HF or Orbax) instead of a pair")
    p.add_argument("--draft", default=None, help="draft model folder (with --model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)


def _parse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=float, default=None, help="judge score below which a prefix is rejected")
    p.add_argument("--max-prefixes", type=int, default=None, help="prefixes verified per pass (K)")
    p.add_argument("--rounds", choices=["single", "multi"], default=None)
    p.add_argument("--segmenter", choices=["delimiter", "stride", "hybrid"], default=None)
    p.add_argument("--gamma", type=int, default=None, help="draft tokens per step in sd mode")
    p.add_argument("--max-draft-tokens", type=int, default=None)


def _convert(args: argparse.Namespace) -> int:
    from parse_jax.models.checkpoint import convert_hf

    out = convert_hf(args.hf, args.out, overwrite=args.overwrite, dtype=args.dtype)
    print(f"wrote {out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from parse_jax.train.pipeline import run_recipe
    from parse_jax.train.recipe import load_recipe

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    recipe = load_recipe(args.recipe)
    res = run_recipe(recipe, out=args.out, mode=args.mode, steps=args.steps, progress=not args.no_progress)
    print(f"wrote {res['draft']} and {res['target']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parse-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text: the target alone or with PARSE / speculative decoding")
    g.add_argument("prompt", nargs="+", help="one or more prompts (a batch)")
    _model_args(g)
    g.add_argument("--mode", default=None, help="target | sd | sequential | parse (default: parse on a pair, "
                   "target with --model alone)")
    _parse_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--skip-finite-check", action="store_true", help="do not check weights for NaN/inf on load")
    g.add_argument("--stats", action="store_true", help="print generation stats to stderr")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="every mode on the same held-out problems of the embedded task, one process")
    _model_args(b)
    b.add_argument("--n", type=int, default=500, help="held-out problems")
    b.add_argument("--modes", default="target,sd,sequential,parse,draft",
                   help="comma-separated: target, sd, sequential, parse, draft (the draft alone: the ceiling)")
    _parse_args(b)
    b.add_argument("--task", default="default", help="embedded task preset")
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--batch-size", type=int, default=16)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", default=None, help="write the results (DESIGN §4 schema) here")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_bench)

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
    t.add_argument("--steps", type=int, default=None, help="override both phases' step counts (quick runs)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except ParseJaxError as e:
        print(f"parse-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
