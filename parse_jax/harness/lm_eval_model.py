"""parse-jax as an lm-evaluation-harness model: `parse-jax` in lm-eval's model registry.

    import parse_jax.harness.lm_eval_model  # registers "parse-jax" (or run the `parse-jax-lm-eval` script)
    lm_eval.simple_evaluate(model="parse-jax", model_args="pair=DIR,mode=parse,parse_config=qwen3_chat", ...)

`model_args`: `pair=DIR` (default: the embedded pair) or `target=DIR[,draft=DIR][,eagle3=DIR]`, `mode` (a bench
mode: target, sd, sequential, parse, parse-multi, eagle3, parse+eagle3; default parse), `parse_config` (anything
`ParseConfig.load` reads: a shipped name, a YAML/JSON path, inline JSON), `batch_size`, `max_gen_toks`, `dtype`,
`seed`, `stats_path` (a JSON file for the speculation stats).

- `generate_until` runs the requests batched through the engine in `mode`, each group of equal `max_gen_toks` one
  batch at a time; an output is cut at the first of its request's `until` strings (generation stops at the model's
  EOS or `max_gen_toks`).
- `loglikelihood` and `loglikelihood_rolling` score on the target alone (its logits, BOS first).
- The speculation stats of every generation (the field's metrics, parse_jax/runtime/metrics.py) are summed and
  written to `stats_path` and into lm-eval's results (`config.speculation_stats`, via `get_model_info`).

lm-eval 0.4 looks models up only in its own registry (`lm_eval.api.registry.get_model`, filled from
`lm_eval.models.MODEL_MAPPING`): it has no entry point for third-party models, so importing this module is what
registers `parse-jax`; `parse-jax-lm-eval ARGS` is lm-eval's own command line with it registered.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry fills itself only when empty)
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from parse_jax.errors import ConfigError
from parse_jax.runtime.metrics import combine
from parse_jax.utils.validation import check_int

SUMMED = ("new_tokens", "target_passes", "verify_passes", "draft_tokens", "accepted_tokens", "seconds")


def _load_models(pair: str | None, target: str | None, draft: str | None, eagle3: str | None, dtype: str | None):
    from parse_jax.checkpoints.load import load_model
    from parse_jax.checkpoints.pair import load_pair

    if target is None:
        if draft is not None:
            raise ConfigError("model_args draft= needs target= (the model it drafts for)")
        t, d = load_pair(pair, dtype=dtype)
    else:
        if pair is not None:
            raise ConfigError("model_args: give either pair= or target=/draft=, not both")
        t = load_model(target, dtype=dtype)
        d = load_model(draft, dtype=dtype) if draft is not None else None
    if eagle3 is not None:
        from parse_jax.speculation.eagle3 import load_eagle3

        t.eagle3 = load_eagle3(eagle3, t)
    return t, d


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """lm-eval's `model_args` for parse-jax (see the module doc); lm-eval adds `batch_size`, `max_batch_size` and
    `device` to every model's."""

    pair: str | None = None
    target: str | None = None
    draft: str | None = None
    eagle3: str | None = None
    mode: str = "parse"
    parse_config: Any = None
    batch_size: int = 8
    max_gen_toks: int = 256
    dtype: str | None = None
    seed: int = 0
    stats_path: str | None = None

    IGNORED = ("max_batch_size", "device")  # lm-eval's own: one device program per batch, JAX picks the device

    @classmethod
    def of(cls, given: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in given if k not in known and k not in cls.IGNORED)
        if unknown:
            raise ConfigError(f"unknown parse-jax model_args {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        args = {k: v for k, v in given.items() if k in known and v is not None}
        for key in ("batch_size", "max_gen_toks", "seed"):  # "8" from a model_args string
            if isinstance(args.get(key), str) and args[key].strip().isdigit():
                args[key] = int(args[key])
        out = cls(**args)
        check_int("batch_size", out.batch_size, 1)
        check_int("max_gen_toks", out.max_gen_toks, 1)
        check_int("seed", out.seed, 0)
        return out


@register_model("parse-jax")
class ParseJaxLM(LM):
    """An lm-eval model over a parse-jax target/draft pair (see the module doc)."""

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        from parse_jax.harness.runs import mode_runner
        from parse_jax.settings import ParseConfig

        a = ModelArgs.of(model_args)
        self.config = ParseConfig.load(a.parse_config) if a.parse_config is not None else ParseConfig()
        self.batch_size, self.max_gen_toks, self.seed = a.batch_size, a.max_gen_toks, a.seed
        self.mode, self.stats_path = a.mode, a.stats_path
        self.target, self.draft = _load_models(a.pair, a.target, a.draft, a.eagle3, a.dtype)
        self.runner = mode_runner(self.target, self.draft, self.config, a.mode)
        self.stats_parts: list[dict] = []

    # --- generation through the engine ------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            _, kwargs = req.args
            groups.setdefault(int(kwargs.get("max_gen_toks", self.max_gen_toks)), []).append(i)
        for max_new, idx in groups.items():
            for start in range(0, len(idx), self.batch_size):
                batch = idx[start: start + self.batch_size]
                res = self.runner([requests[i].args[0] for i in batch], max_new, self.seed)
                self.stats_parts.append(res.stats)
                for i, text in zip(batch, res.texts):
                    out[i] = cut_at(text, requests[i].args[1].get("until"))
        self._write_stats()
        return [str(x) for x in out]

    def speculation_stats(self) -> dict:
        """The speculation stats of every generation so far: counts summed, the field's rates derived."""
        totals = {k: sum(p.get(k, 0) for p in self.stats_parts) for k in SUMMED if any(k in p for p in
                                                                                        self.stats_parts)}
        return {"mode": self.mode, "batches": len(self.stats_parts), **totals, **combine(self.stats_parts)}

    def _write_stats(self) -> None:
        if self.stats_path is not None:
            from parse_jax.utils.atomic import write_json

            write_json(self.stats_path, self.speculation_stats())

    def get_model_info(self) -> dict:
        return {"parse_jax_mode": self.mode, "parse_config": json.loads(json.dumps(self.config.flat(), default=str)),
                "speculation_stats": self.speculation_stats()}

    # --- scoring on the target ---------------------------------------------------------------------------

    def _prefix(self) -> list[int]:
        tok = self.target.tokenizer
        first = tok.bos_id if tok.bos_id is not None else tok.eos_id
        return [] if first is None else [int(first)]

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) on the target and whether greedy decoding writes it."""
        full = context + continuation
        length = -(-len(full) // 16) * 16  # right padding to a multiple of 16: fewer shapes to compile
        ids = np.zeros((1, length), np.int64)
        ids[0, : len(full)] = full
        logits = np.asarray(self.target.logits(ids), np.float64)[0, len(context) - 1: len(full) - 1]
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        cont = np.asarray(continuation)
        return float(logp[np.arange(len(cont)), cont].sum()), bool((logits.argmax(-1) == cont).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        tok, out = self.target.tokenizer, []
        for req in requests:
            context, continuation = req.args
            out.append(self._score(self._prefix() + tok.encode(context), tok.encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        tok, out = self.target.tokenizer, []
        prefix = self._prefix()
        width = self.target.config.max_position_embeddings
        for req in requests:
            (text,) = req.args
            windows = get_rolling_token_windows(token_list=tok.encode(text), prefix_token=prefix[0] if prefix else 0,
                                                max_seq_len=width, context_len=1)
            total = 0.0
            for window in map(make_disjoint_window, windows):
                context, continuation = list(window[0]), list(window[1])
                total += self._score(context, continuation)[0]
            out.append(total)
        return out


def cut_at(text: str, until: Any) -> str:
    """`text` up to the first occurrence of any stop string of `until` (a string or a list of them)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    ends = [text.find(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else text


def main() -> None:
    """`parse-jax-lm-eval ARGS`: lm-eval's command line (`lm-eval run --model parse-jax ...`) with parse-jax
    registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
