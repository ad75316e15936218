"""What lm-eval's `model_args` say to parse-jax's lm-eval model (`lm_eval_model.py`): the models to load (the pair,
model folders, steps of training runs) and the engine's settings, read from a `key=value` string or an object and
checked before anything loads."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from lm_eval.utils import handle_arg_string

from parse_jax.errors import ConfigError, ParseJaxError
from parse_jax.utils.validation import check_int, shorten

DEFAULT_BATCH = 8  # rows per engine call unless `batch_size` says otherwise

RUN_ARGS = {"target": ("step", "params_path", "config_from"),  # `load_model`'s, per model: a step of a training run
            "draft": ("draft_step", "draft_params_path", "draft_config_from")}


def load_models(a: ModelArgs):
    """(target, draft) as `model_args` name them: the pair, or model folders / steps of training runs."""
    from parse_jax.checkpoints.load import load_model
    from parse_jax.checkpoints.pair import load_pair

    if a.target is None:
        if a.draft is not None:
            raise ConfigError("model_args draft= needs target= (the model it drafts for)")
        t, d = load_pair(a.pair, dtype=a.dtype)
    else:
        if a.pair is not None:
            raise ConfigError("model_args: give either pair= or target=/draft=, not both")
        with run_args_named("target"):
            t = load_model(a.target, a.step, a.params_path, a.config_from, dtype=a.dtype)
        d = None
        if a.draft is not None:
            with run_args_named("draft"):
                d = load_model(a.draft, a.draft_step, a.draft_params_path, a.draft_config_from, dtype=a.dtype)
    if a.eagle3 is not None:
        from parse_jax.speculation.eagle3 import load_eagle3

        t.eagle3 = load_eagle3(a.eagle3, t)
    return t, d


@contextlib.contextmanager
def run_args_named(who: str):
    """A loader's errors inside, said to be about `who`'s model ("target" or "draft": the loader names its own
    arguments, `step`, `params_path`, `config_from`, which the draft's `model_args` spell `draft_step`, ...)."""
    try:
        yield
    except ParseJaxError as e:
        raise type(e)(f"model_args {who}: {e}") from None


def loaded_models(a: ModelArgs, target, draft) -> dict:
    """Which models were loaded, as `parse-jax eval`'s provenance names them (`target_step`: the step read)."""
    from parse_jax.checkpoints.runs import shown_path

    out = {"pair": shown_path(a.pair) or ("embedded" if a.target is None else None), "target": shown_path(a.target),
           "draft": shown_path(a.draft), "eagle3": shown_path(a.eagle3), "dtype": a.dtype}
    for name, model in (("target", target), ("draft", draft)):
        read = getattr(model, "loaded_from", None)  # set by the run loader only: the step and sub-tree it read
        if read:
            out[f"{name}_step"], out[f"{name}_params_path"] = read["step"], read["params_path"]
        config_from = getattr(a, RUN_ARGS[name][2])
        if config_from is not None:
            out[f"{name}_config_from"] = shown_path(config_from)
    return out


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """lm-eval's `model_args` for parse-jax (see the module doc); lm-eval adds `batch_size`, `max_batch_size` and
    `device` to every model's."""

    pair: str | None = None
    target: str | None = None
    draft: str | None = None
    eagle3: str | None = None
    step: int | None = None  # the target's, where target= is a training run (`load_model`'s); default: the latest
    params_path: str | None = None
    config_from: str | None = None
    draft_step: int | None = None  # the same for the draft's run
    draft_params_path: str | None = None
    draft_config_from: str | None = None
    mode: str = "parse"
    parse_config: Any = None
    batch_size: int | str = DEFAULT_BATCH
    max_batch_size: int | None = None
    max_gen_toks: int = 256
    dtype: str | None = None
    seed: int = 0
    stats_path: str | None = None
    enable_thinking: bool | None = None

    IGNORED = ("device",)  # lm-eval's own: JAX picks the device

    @classmethod
    def of(cls, given: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in given if k not in known and k not in cls.IGNORED)
        if unknown:
            raise ConfigError(f"unknown parse-jax model_args {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        args = {k: v for k, v in given.items() if k in known and v is not None}
        for key in ("batch_size", "max_batch_size", "max_gen_toks", "seed", "step", "draft_step"):  # "8" as text
            if isinstance(args.get(key), str) and args[key].strip().isdigit():
                args[key] = int(args[key])
        out = cls(**args)
        check_int("max_gen_toks", out.max_gen_toks, 1)
        check_int("seed", out.seed, 0)
        for who, keys in RUN_ARGS.items():
            named = [k for k in keys if getattr(out, k) is not None]
            if named and getattr(out, who) is None:
                raise ConfigError(f"model_args {', '.join(named)}: only with {who}=RUN_DIR (a training run: an Orbax "
                                  "CheckpointManager folder)")
            if getattr(out, keys[0]) is not None:
                check_int(f"model_args {keys[0]}", getattr(out, keys[0]), 0)
            for key in keys[1:]:
                if getattr(out, key) is not None and not isinstance(getattr(out, key), str):
                    raise ConfigError(f"model_args {key} must be a path, got {getattr(out, key)!r}")
        if out.max_batch_size is not None:
            check_int("max_batch_size", out.max_batch_size, 1)
        if out.enable_thinking not in (None, True, False):
            raise ConfigError(f"model_args enable_thinking must be true or false, got {out.enable_thinking!r}")
        if out.stats_path is not None:  # before the run, not after it
            from parse_jax.utils.atomic import check_file_writable

            check_file_writable(out.stats_path)
        return out

    def rows(self) -> int:
        """Rows per engine call: `batch_size`, where lm-eval's `auto` / `auto:N` (which probe a torch model's memory)
        mean parse-jax's default, at most `max_batch_size` (as lm-eval caps only its automatic sizes)."""
        size = self.batch_size
        if isinstance(size, str) and (size == "auto" or size.startswith("auto:")):
            return min(DEFAULT_BATCH, self.max_batch_size or DEFAULT_BATCH)
        return check_int("batch_size (a number, auto or auto:N)", size, 1)


def parse_args_string(arg_string: str) -> dict[str, Any]:
    """`key=value,key=value` as lm-eval's `simple_parse_args_string` reads it (each value through its
    `handle_arg_string`), but split only at commas outside braces, brackets and quoted strings (a value that
    starts with a quote, or a string inside braces), so that inline JSON
    (`parse_config={"schedule": "fixed", "threshold": 0.3}`) is one value."""
    parts, depth, quote, start, escaped = [], 0, None, 0, False
    for at, ch in enumerate(arg_string):
        if quote:
            quote = None if ch == quote and not escaped else quote
            escaped = ch == "\\" and not escaped
        elif ch in "\"'" and (depth or arg_string[at - 1: at] == "="):  # a quoted value, or JSON's strings
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(arg_string[start:at])
            start = at + 1
    if depth or quote:
        raise ConfigError(f"model_args {shorten(arg_string)!r}: unbalanced {quote or 'braces or brackets'}")
    parts.append(arg_string[start:])
    out = {}
    for part in (p for p in parts if p.strip()):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"model_args {shorten(part.strip())!r}: expected key=value")
        out[key.strip()] = handle_arg_string(value)
    return out
