"""The argument parser of every command. Nothing here imports jax: `parse-jax --help` builds it without.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from parse_jax import __version__
from parse_jax.cli.commands import (
    cmd_bench,
    cmd_calibrate,
    cmd_convert,
    cmd_eval,
    cmd_export,
    cmd_generate,
    cmd_sweep,
    cmd_train,
    cmd_train_eagle3,
)
from parse_jax.cli.lower import add_lower_command
from parse_jax.cli.profile import add_profile_command
from parse_jax.harness.eval.extract import DEFAULT_INSTRUCTION
from parse_jax.settings import (
    BATCHING,
    DEFAULT_BATCHING,
    MODES,
    ParseConfig,
    about,
    check_setting,
    choices_of,
    default_of,
    setting_type,
)
from parse_jax.train.recipe import Eagle3Spec, PhaseSpec
from parse_jax.utils.validation import SEED_MAX, check_float, check_int


def add_run_step_flags(p, run: str) -> None:
    """--step, --params-path and --config-from: which step of `run` (a training run) to load, and how."""
    p.add_argument("--step", type=int, default=None, help=f"step of {run} (default: the latest finished)")
    p.add_argument("--params-path", default=None,
                   help=f"params sub-tree of {run}'s checkpoints, e.g. state/params (default: found)")
    p.add_argument("--config-from", default=None,
                   help=f"HF or parse-jax model folder with {run}'s config and tokenizer (default: the run folder's "
                        "run.json / config files)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default=None, help="folder with target/ and draft/ (default: the embedded pair)")
    p.add_argument("--model", "--target", dest="model", default=None,
                   help="target model folder (HF or Orbax, or a training run: see --step) instead of a pair")
    p.add_argument("--draft", default=None, help="draft model folder (with --model)")
    r = p.add_argument_group("training runs (Orbax CheckpointManager folders given as --target / --draft)")
    add_run_step_flags(r, "the --target run")
    r.add_argument("--draft-step", type=int, default=None, help="step of the --draft run (default: the latest)")
    r.add_argument("--draft-params-path", default=None, help="params sub-tree of the --draft run's checkpoints")
    r.add_argument("--draft-config-from", default=None, help="config + tokenizer folder for the --draft run")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="cast the weights on load (default: the checkpoint's dtype, except the embedded pair and, on "
                        "CPUs, a pair folder's parse-jax checkpoints: they load as float32)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 head folder for the target (default: the pair's eagle3/)")
    p.add_argument("--skip-finite-check", action="store_true", help="do not check weights for NaN/inf on load")
    from parse_jax.distributed.args import add_distributed_args  # no jax import while building the parser

    add_distributed_args(p)



def add_parse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parse-config", dest="parse_config_file", default=None, metavar="NAME|FILE|JSON",
                   help="PARSE settings, read as ParseConfig.load reads them: a shipped config by name (qwen3_chat), "
                        "a YAML or JSON file of ParseConfig fields (verify_suffix, judge_yes, judge_no, delimiter, "
                        "threshold, ...) or inline JSON ('{\"threshold\": 0.3}'); --set and the flags below "
                        "override it")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="one ParseConfig field (repeatable), the value read as a YAML scalar, e.g. --set "
                        "threshold=0.3; a text field takes the text as given, or a quoted YAML string with escapes: "
                        "--set 'delimiter=\"\\n\\n\"'; overrides --parse-config, overridden by the flags below")
    for key in PARSE_FLAGS:
        cls, name = ParseConfig.flat_setting(key)
        add_setting_flag(p, cls, name, flag="--" + key.replace("_", "-"), default=None)



def add_eos_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eos-ids", default=None, metavar="ID,ID",
                   help="comma-separated stop token ids, replacing the model's own (e.g. 151645,151643); none: "
                        "no stop id (every row writes its whole budget)")



def add_batching_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batching", choices=BATCHING, default=DEFAULT_BATCHING,
                   help="continuous: each mode takes every prompt at once, --batch-size rows in flight, a finished "
                        "row's slot refilled (target and multi-round parse); fixed: chunks of --batch-size "
                        "(docs/design.md §7)")



def add_data_args(p: argparse.ArgumentParser) -> None:
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
    add_bad_line_arg(p)


def add_bad_line_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--on-bad-line", choices=["error", "skip"], default="error",
                   help="a missing or malformed line of --data (or, in eval, a record too long for the models): "
                        "stop with the list of bad lines, or skip them (reported)")



# The flat ParseConfig settings the PARSE commands take as flags (type, choices, help, default and range: the fields')
PARSE_FLAGS = ("threshold", "max_prefixes", "rounds", "segmenter", "gamma", "max_draft_tokens", "eagle3_gamma",
               "eagle3_tree", "eagle3_tree_top_k", "eagle3_tree_width", "schedule")


def add_setting_flag(p: argparse.ArgumentParser, cls: type, name: str, *, flag: str | None = None,
                     default: Any = dataclasses.MISSING, help: str | None = None) -> argparse.Action:
    """--NAME (or `flag`) for field `name` of settings dataclass `cls`, all from the field: its type or choices, its
    help text, its default (unless `default` is given; None: unset, the field's default named in the help) and its
    range, which `check_args` applies. `help` replaces the field's text."""
    field_default = default_of(cls, name)
    text = help or about(cls, name).help
    if default is None and help is None:
        text = f"{text} (default: {field_default})"
    choices = choices_of(cls, name)
    kind = {"choices": choices} if choices is not None else {"type": setting_type(cls, name)}
    action = p.add_argument(flag or "--" + name.replace("_", "-"),
                            default=field_default if default is dataclasses.MISSING else default, help=text, **kind)
    action.setting = (cls, name)  # what check_args checks the value against
    return action


# (flag dest, kind, minimum, maximum, open minimum): the ranges of the run-level flags, which no settings dataclass
# holds (those of the settings flags come from their fields)
FLAG_CHECKS = (
    ("n", int, 1, None, False), ("max_new_tokens", int, 1, None, False), ("batch_size", int, 1, None, False),
    ("repeats", int, 1, None, False), ("prompt_len", int, 1, None, False),
    ("seed", int, 0, SEED_MAX, False), ("top_k", int, 0, None, False),
    ("step", int, 0, None, False), ("draft_step", int, 0, None, False), ("num_processes", int, 1, None, False),
    ("coordinator_timeout", int, 1, None, False),
    ("process_id", int, 0, None, False), ("temperature", float, 0.0, None, False), ("top_p", float, 0.0, 1.0, True),
)



def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every numeric flag inside its range (NaN and inf refused), and --mesh well formed: before any work, so a
    bad value never reaches a model load or a file. `parser`: build_parser()'s, which parsed `args`."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    settings = {a.dest: a for a in sub.choices[args.command]._actions if hasattr(a, "setting")}
    for dest, action in settings.items():
        value = getattr(args, dest, None)
        if value is not None:
            check_setting(*action.setting, value, action.option_strings[0])
    for dest, kind, lo, hi, open_lo in FLAG_CHECKS:
        value = getattr(args, dest, None)
        if value is None or dest in settings:
            continue
        flag = "--" + dest.replace("_", "-")
        if kind is int:
            check_int(flag, value, lo, hi)
        else:
            check_float(flag, value, lo, hi, min_open=open_lo)
    for dest in ("mesh", "lower_mesh"):  # lower's --mesh: an abstract mesh of chips
        if getattr(args, dest, None) is not None:  # an empty --mesh '' too: refused, never a silent single device
            from parse_jax.distributed.mesh import parse_mesh_spec

            parse_mesh_spec(getattr(args, dest), name="--mesh")



def show_defaults(p: argparse.ArgumentParser) -> None:
    """Options with no help text still show their default."""
    for action in p._actions:
        if action.help is None and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"



class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), like every other parse-jax error; a flag the command does not
    take is reported by that command's parser (`parse-jax eval: error: unrecognized arguments: --foo (see parse-jax
    eval --help)`), not the top-level one, which would name no command."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
            command = getattr(args, "command", None)
            parser = sub.choices[command] if sub is not None and command in sub.choices else self
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return args



class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every --help shows each option's default, except flags, options with no default and help that names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return text + " (default: %(default)s)"



def add_output_args(p: argparse.ArgumentParser) -> None:
    """-v / -q and the compile cache: what every command takes."""
    from parse_jax.utils.compile_cache import ENV_VAR, default_dir

    o = p.add_argument_group("messages and caching")
    o.add_argument("-v", "--verbose", action="count", default=0, help="more messages on stderr (debug)")
    o.add_argument("-q", "--quiet", action="count", default=0,
                   help="only warnings and errors on stderr, no progress bars (-qq: errors only)")
    o.add_argument("--no-compile-cache", action="store_true",
                   help=f"compile every program afresh instead of loading it from the persistent cache "
                        f"({default_dir()}; {ENV_VAR}=DIR moves it, {ENV_VAR}=0 turns it off)")



def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="parse-jax", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text: the target alone or with PARSE / speculative decoding")
    g.add_argument("prompt", nargs="+", help="one or more prompts (a batch)")
    add_model_args(g)
    g.add_argument("--mode", default=None, help=f"{' | '.join(MODES)} (default: parse on a pair, target with "
                   "--model alone)")
    add_parse_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template (any mode)")
    g.add_argument("--no-thinking", action="store_true",
                   help="with --chat: render the template with enable_thinking=False (Qwen3)")
    add_eos_arg(g)
    g.add_argument("--stats", action="store_true", help="print generation stats to stderr (one JSON object)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (prompt, text, tokens, new_tokens, and stats: the one "
                        "call's), one per line, not the text")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="every mode on the same held-out problems of the embedded task, one process")
    add_model_args(b)
    b.add_argument("--n", type=int, default=None,
                   help="held-out problems (default: 300; with --data: every record)")
    b.add_argument("--modes", default="all",
                   help="comma-separated bench modes, or all (every mode this pair can run): the engine's modes, "
                        "parse-multi (PARSE with rounds=multi; parse is single round) and draft (the draft alone)")
    add_parse_args(b)
    b.add_argument("--task", default="default", help="embedded task preset")
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--batch-size", type=int, default=1,
                   help="requests per generate call; 1 is the regime speculation is for (README, Benchmarks)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--seed", type=int, default=0)
    add_batching_arg(b)
    add_data_args(b)
    add_eos_arg(b)
    b.add_argument("--json", default=None, help="write the results (docs/design.md §3 schema) here")
    b.add_argument("--out", default=None, help="folder for bench.json, bench.md and PNG plots")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)

    def run_args(p: argparse.ArgumentParser, n: int) -> None:
        add_model_args(p)
        add_parse_args(p)
        p.add_argument("--mode", default="parse", help="the PARSE mode to vary (parse, parse-multi, sequential, ...)")
        p.add_argument("--n", type=int, default=None, help=f"problems (default: {n}; with --data: every record)")
        add_data_args(p)
        p.add_argument("--task", default="default", help="embedded task preset")
        p.add_argument("--max-new-tokens", type=int, default=32)
        p.add_argument("--batch-size", type=int, default=16)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        add_batching_arg(p)
        add_eos_arg(p)
        p.add_argument("--no-progress", action="store_true")

    s = sub.add_parser("sweep", help="target once, then a PARSE mode per value of one parameter (held-out problems)")
    run_args(s, 200)
    s.add_argument("--param", required=True, choices=["threshold", "max_prefixes", "segmenter", "max_draft_tokens"])
    s.add_argument("--values", required=True,
                   help="comma-separated values; segmenter: delimiter, hybrid, stride or stride:DELTA")
    s.add_argument("--out", required=True, help="folder for sweep_PARAM.json/.md/.png and sweep_PARAM_pareto.png")
    s.set_defaults(func=cmd_sweep)

    k = sub.add_parser("calibrate", help="the threshold that accepts the most draft tokens while its accuracy "
                                         "stays within a tolerance of the target's, on dev problems (the task's "
                                         "train split, never the test split)")
    run_args(k, 200)
    k.add_argument("--tolerance", type=float, default=0.01, help="allowed accuracy loss (0.01 = 1 point)")
    k.add_argument("--thresholds", default="0.05,0.1,0.2,0.3,0.5,0.7,0.8,0.9,0.95,0.99")
    k.add_argument("--out", required=True, help="folder for calibrate.json/.md/.png and parse_config.yaml")
    k.set_defaults(func=cmd_calibrate)

    e = sub.add_parser("eval", help="accuracy on a JSONL file (GSM8K-style or embedded-task records), resumable")
    e.add_argument("--data", required=True, help="JSONL: {question, answer: '... #### N'} or {prompt[, solution]}")
    add_model_args(e)
    e.add_argument("--mode", default=None, help="a bench mode (default: parse on a pair, target with --model alone); "
                                                "parse and parse+eagle3 run single round unless --rounds (or the "
                                                "--parse-config file) says single or multi; parse-multi: multi round")
    add_parse_args(e)
    e.add_argument("--out", required=True, help="results JSONL (appended per record; rerun to resume); the summary "
                                                "goes beside it (results.jsonl -> results.summary.json)")
    e.add_argument("--task", default="default", help="embedded task preset that grades task records")
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--batch-size", type=int, default=8)
    add_batching_arg(e)
    e.add_argument("--limit", type=int, default=None, metavar="N",
                   help="evaluate only the first N records (file order), as lm-eval's --limit; a later run with a "
                        "larger N resumes the same results file")
    add_bad_line_arg(e)
    e.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="GSM8K questions through the model's chat template (auto: when it has one)")
    e.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each question in chat format")
    e.add_argument("--no-thinking", action="store_true",
                   help="render the chat template with enable_thinking=False (Qwen3)")
    add_eos_arg(e)
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=cmd_eval)

    add_profile_command(sub, add_model_args)
    add_lower_command(sub, add_parse_args)

    c = sub.add_parser("convert", help="convert an HF folder (config.json + safetensors) to an Orbax folder")
    c.add_argument("--hf", required=True, help="HF model folder")
    c.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=cmd_convert)

    x = sub.add_parser("export", help="write a model (HF folder, Orbax folder, a training run's step) as a HF folder "
                                      "(config.json + model.safetensors + tokenizer) that transformers and vLLM load",
                       description="write a model (HF folder, Orbax folder, a training run's step) as a HF folder "
                                   "(config.json + model.safetensors + tokenizer) that transformers and vLLM load; "
                                   "the model is read whole into host memory, so export takes no --mesh")
    x.add_argument("--model", "--target", dest="model", required=True,
                   help="the model: a HF or parse-jax folder, or a training run (see --step)")
    add_run_step_flags(x, "the --model run")
    x.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    x.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the model's own")
    x.add_argument("--overwrite", action="store_true")
    x.set_defaults(func=cmd_export, draft=None, draft_step=None, draft_params_path=None, draft_config_from=None)

    t = sub.add_parser("train", help="train a draft/target pair from a recipe in configs/ (resumable)")
    t.add_argument("--recipe", required=True, help="recipe name (configs/NAME.yaml) or path to a YAML file")
    t.add_argument("--out", default=None, help="output folder (default: the recipe's `out`)")
    m = t.add_mutually_exclusive_group()
    m.add_argument("--resume", dest="mode", action="store_const", const="resume",
                   help="require checkpoints in --out and continue from them")
    m.add_argument("--fresh", dest="mode", action="store_const", const="fresh",
                   help="delete the checkpoints in --out, and the models they finished, and start over")
    t.set_defaults(mode="auto")
    add_setting_flag(t, PhaseSpec, "steps", default=None,
                     help=f"{about(PhaseSpec, 'steps').help} of every phase instead of the recipe's (quick runs)")
    t.add_argument("--grow-from", default=None, metavar="MODEL_DIR",
                   help="a trained narrow target (the recipe's target_model shape) to widen instead of training "
                        "the target phase (recipes with grow.enabled)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    h = sub.add_parser("train-eagle3", help="train an EAGLE-3 head for a target, on a JSONL dataset (--data) or the "
                                            "embedded task (resumable)")
    add_model_args(h)
    h.add_argument("--out", required=True, help="run folder: data, checkpoints, and the head in OUT/eagle3 (with "
                                                "--data also OUT/speculators, the format vLLM loads)")
    h.add_argument("--task", default="default", help="embedded task preset (without --data)")
    h.add_argument("--data", default=None, metavar="FILE.jsonl",
                   help='train on these records: {"prompt", "response"} or chat {"messages": [...]} (the last '
                        "assistant message is the response), for any HF target")
    h.add_argument("--regenerate", action="store_true",
                   help="with --data: the target writes the responses (greedy) instead of taking them as given")
    h.add_argument("--verifier", default=None,
                   help="with --data: the target's name or path written into OUT/speculators' speculators_config "
                        "(default: the --model folder, as an absolute path)")
    for name in ("steps", "batch_size", "lr", "unroll", "samples", "seq_len", "seed", "draft_vocab_size"):
        add_setting_flag(h, Eagle3Spec, name)
    hm = h.add_mutually_exclusive_group()
    hm.add_argument("--resume", dest="mode", action="store_const", const="resume",
                    help="require a checkpoint in --out and continue from it")
    hm.add_argument("--fresh", dest="mode", action="store_const", const="fresh",
                    help="delete the head's checkpoints in --out, and the head they finished, and start over")
    h.set_defaults(mode="auto")
    h.add_argument("--no-progress", action="store_true")
    h.set_defaults(func=cmd_train_eagle3)
    for choice in sub._choices_actions:  # each command's --help starts with what it does
        command = sub.choices[choice.dest]
        command.description = command.description or choice.help
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
        add_output_args(command)
        show_defaults(command)
    return parser
