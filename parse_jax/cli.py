"""`parse-jax` command line: generate, convert, train."""

from __future__ import annotations

import argparse
import sys

from parse_jax.errors import ConfigError, ParseJaxError


def _generate(args: argparse.Namespace) -> int:
    from parse_jax.decode import generate
    from parse_jax.models.checkpoint import load_model

    model = load_model(args.model, dtype=args.dtype, check_finite=not args.skip_finite_check)
    prompts = list(args.prompt)
    if args.chat:
        prompts = [model.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    res = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, add_bos=not args.chat)
    for text in res.texts:
        print(text)
    if args.stats:
        print(res.stats, file=sys.stderr)
    return 0


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

    g = sub.add_parser("generate", help="generate text with a model (HF or Orbax folder)")
    g.add_argument("prompt", nargs="+", help="one or more prompts (a batch)")
    g.add_argument("--model", required=True, help="HF folder or Orbax folder written by parse-jax")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--skip-finite-check", action="store_true", help="do not check weights for NaN/inf on load")
    g.add_argument("--stats", action="store_true", help="print generation stats to stderr")
    g.set_defaults(func=_generate)

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
    try:
        return args.func(args)
    except ParseJaxError as e:
        print(f"parse-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
