"""parse-jax as an lm-evaluation-harness model: `parse-jax` in lm-eval's model registry.

    import parse_jax.harness.lm_eval_model  # registers "parse-jax" (or run the `parse-jax-lm-eval` script)
    lm_eval.simple_evaluate(model="parse-jax", model_args="pair=DIR,mode=parse,parse_config=qwen3_chat", ...)

`model_args`: `pair=DIR` (default: the embedded pair) or `target=DIR[,draft=DIR][,eagle3=DIR]`, where a training
run (an Orbax CheckpointManager folder) takes `load_model`'s `step`, `params_path`, `config_from` (the draft's:
`draft_step`, `draft_params_path`, `draft_config_from`), `mode` (a bench mode: target, sd, sequential, parse,
parse-multi, eagle3, parse+eagle3; default parse), `parse_config` (anything `ParseConfig.load` reads: a shipped
name, a YAML/JSON path, inline JSON), `batch_size` (a number, or lm-eval's `auto` / `auto:N`: parse-jax's default,
at most `max_batch_size`), `max_gen_toks`, `dtype`, `seed`, `stats_path` (a JSON file for the speculation stats),
`enable_thinking` (passed to the chat template, as lm-eval's HF model passes it). A `model_args` string is split
at commas outside braces, brackets and quotes (`parse_config={"schedule": "fixed", "threshold": 0.3}` is one
value). What was loaded (paths, the step read) is in lm-eval's results as `config.parse_jax_models`.

- `generate_until` groups the requests by their generation kwargs (the new-token budget under any of lm-eval's
  names for it, `until` and the sampling temperature that `do_sample` / `temperature` ask for, as lm-eval's HF
  model reads them; kwargs that would change the output and that this model does not pass to the engine are
  refused, unknown ones warned about) and runs each group batched through the engine in `mode`. A request's stop
  strings end its row: those that are one token are stop ids of the device program beside the model's EOS; in
  the modes whose output a resumed call continues exactly (target, draft, sd, eagle3) a longer one is checked on
  the committed text between segments of 16, 32, 64, ... tokens; PARSE modes run a batch in one call
  (docs/design.md §8). Outputs are cut by lm-eval's own `postprocess_generated_text`. A context longer than the
  mode holds with its budget keeps its last tokens (as lm-eval's HF model cuts to `max_length - max_gen_toks`;
  the limit is the longest the mode's own checks take), with one warning per call; an error of a batch names the
  request's index in the call.
- `loglikelihood` and `loglikelihood_rolling` score on the target alone, a request's text encoded as lm-eval's HF
  model encodes it (`encode_pair`: the tokenizer's own special tokens; an empty context, and a document's first
  window, after its BOS, or its EOS where it has none).
- `--apply_chat_template` renders lm-eval's chat history with the target tokenizer's own chat template (as
  transformers renders it, `continue_final_message` included); a target without one is refused at that flag.
- The speculation stats of every generation (the field's metrics, parse_jax/runtime/metrics.py) are summed, with
  what `schedule="auto"` ran per request (`schedule_ran`) and the count of scored requests, and written to
  `stats_path` after every call (scoring ones too) and into lm-eval's results (`config.speculation_stats`, via
  `get_model_info`).

How lm-eval finds it: pyproject declares it in the `lm_eval.models` entry-point group, which lm-eval's plugin
discovery reads (lm-eval's main branch, after 0.4.13) so that a bare `lm_eval --model parse-jax` needs nothing
else. lm-eval 0.4.13 reads no entry point (its registry holds `lm_eval.models.MODEL_MAPPING` and what
`register_model` adds in the process): there, importing this module registers `parse-jax`, and
`parse-jax-lm-eval ARGS` is lm-eval's own command line with it imported (docs/design.md §8).
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import sys
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry fills itself only when empty)
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from parse_jax.errors import ConfigError, InputError, ParseJaxError
from parse_jax.harness.lm_eval_args import ModelArgs, load_models, loaded_models, parse_args_string
from parse_jax.runtime.metrics import combine
from parse_jax.utils.validation import SEED_MAX, check_float, check_int, shorten

FIRST_SEGMENT = 16  # new tokens of a generation's first segment when a stop string spans tokens; then doubled
RESUMABLE = ("target", "draft", "sd", "eagle3")  # modes whose output a resumed call continues exactly
BUDGET_NAMES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's priority
# kwargs this model does not pass to the engine (its runners take a temperature), with the values that mean "off"
UNSUPPORTED_WHEN_SAMPLING = {"top_k": (None, 0, -1), "top_p": (None, 1, 1.0), "min_p": (None, 0, 0.0)}
UNSUPPORTED = {"num_beams": (None, 1), "repetition_penalty": (None, 1, 1.0), "no_repeat_ngram_size": (None, 0),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "length_penalty": (None, 1, 1.0)}
READ = ("until", "do_sample", "temperature", *BUDGET_NAMES, *UNSUPPORTED_WHEN_SAMPLING, *UNSUPPORTED)
SUMMED = ("new_tokens", "target_passes", "verify_passes", "draft_tokens", "accepted_tokens", "seconds")
@register_model("parse-jax")
class ParseJaxLM(LM):
    """An lm-eval model over a parse-jax target/draft pair (see the module doc)."""

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        from parse_jax.runtime.requests import resolve_eos
        from parse_jax.settings import ParseConfig

        a = ModelArgs.of(model_args)
        self.config = ParseConfig.load(a.parse_config) if a.parse_config is not None else ParseConfig()
        self.batch_size, self.max_gen_toks, self.seed = a.rows(), a.max_gen_toks, a.seed
        self.mode, self.stats_path = a.mode, a.stats_path
        self.chat_template_args = {} if a.enable_thinking is None else {"enable_thinking": a.enable_thinking}
        self.target, self.draft = load_models(a)
        self.models = loaded_models(a, self.target, self.draft)
        self.eos_ids = [int(x) for x in resolve_eos(self.target) if x >= 0]  # the model's own stop ids
        self._runners: dict[tuple[tuple[int, ...], float], Any] = {}
        self._limits: dict[tuple[tuple[int, ...], float, int], int] = {}
        self._runner(())  # the mode's checks (its models, its settings) now, not at the first request
        self.stats_parts: list[dict] = []
        self.schedule_ran: collections.Counter[str] = collections.Counter()  # requests per choice schedule ran
        self.scored = 0  # loglikelihood(_rolling) requests scored

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ParseJaxLM:
        return cls.create_from_arg_obj(parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> ParseJaxLM:
        """lm-eval's `batch_size` / `max_batch_size` / `device` beside `model_args`, a `model_args` value winning:
        lm-eval's command line always passes `--batch_size` (default 1), which would otherwise collide."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # --- generation through the engine ------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple[int, tuple[str, ...], float], list[int]] = {}  # as lm-eval's HF model: by gen kwargs
        for i, req in enumerate(requests):
            _, kwargs = req.args
            key = (new_token_budget(kwargs, self.max_gen_toks), stop_strings(kwargs.get("until")),
                   sampling_temperature(kwargs))
            groups.setdefault(key, []).append(i)
        tok = self.target.tokenizer
        plan, cut = [], {}
        for (max_new, until, temperature), idx in groups.items():  # every context cut to fit before any run
            stop_ids = single_token_stops(tok, until)
            runner = self._runner(stop_ids, temperature)
            ids, cut_here = self._fitted(runner, (stop_ids, temperature, max_new), requests, idx)
            cut.update(cut_here)
            plan.append((max_new, until, stop_ids, runner, idx, ids))
        if cut:  # as lm-eval's HF model cuts (it warns per batch): once, with the count
            limits = sorted(set(cut.values()))
            _warn_once(f"generate_until: {len(cut)} of {len(requests)} requests had a context longer than mode "
                       f"{self.mode} holds with their max_gen_toks; cut from the left to the last "
                       f"{' / '.join(map(str, limits))} tokens, as lm-eval's HF model cuts it (requests "
                       f"{shorten(', '.join(map(str, sorted(cut))))})")
        for max_new, until, stop_ids, runner, idx, ids in plan:
            # one job per group, as `parse-jax eval` declares its records: under schedule="auto" a choice's program
            # setup is charged to the group's rows (docs/design.md §7). Not where rows go on in segments (several
            # calls per prompt would spend the job's count before its first batch ends)
            segmented = len(stop_ids) < len(until) and self.mode in RESUMABLE  # a stop string over several tokens
            with contextlib.nullcontext() if segmented else runner.job(len(idx)):
                for start in range(0, len(idx), self.batch_size):
                    batch, prompts = idx[start: start + self.batch_size], ids[start: start + self.batch_size]
                    seeds = [(self.seed + i) % (SEED_MAX + 1) for i in batch]  # each request its own draws
                    texts, ran = (self._generate_in_segments(runner, batch, prompts, max_new, until, stop_ids, seeds)
                                  if segmented else self._generate(runner, batch, prompts, max_new, seeds))
                    for i, text, names in zip(batch, texts, ran):
                        out[i] = postprocess_generated_text(text, list(until), None)  # lm-eval's own cut
                        self.schedule_ran.update(names)
        self._write_stats()
        return [str(x) for x in out]

    def _fitted(self, runner, key: tuple, requests, idx: list[int]) -> tuple[list[list[int]], dict[int, int]]:
        """(ids, {request: kept length} of those cut) of requests `idx` (one group: `key` is its stop ids,
        temperature and budget): each context cut from the left to the longest that `runner` holds with the group's
        budget, as lm-eval's HF model cuts to `max_length - max_gen_toks`."""
        from parse_jax.runtime.requests import encode_prompts

        with requests_named("generate_until", idx):
            ids = encode_prompts(self.target, [requests[i].args[0] for i in idx])  # as the runner would encode them
        try:
            runner.check([max(ids, key=len)], key[2], self.seed)  # the longest fits: every context does
            return ids, {}
        except InputError:
            pass
        limit = self._context_limit(runner, key, idx[0])
        return [p[-limit:] for p in ids], {i: limit for i, p in zip(idx, ids) if len(p) > limit}

    def _context_limit(self, runner, key: tuple, first: int) -> int:
        """The longest context `runner`'s own checks accept with budget `key[2]`: the mode's positions (and its
        passes' room past the budget), whatever schedule and rounds it may run; found by bisection on those
        checks, once per setting."""
        if key not in self._limits:
            max_new = key[2]
            try:
                runner.check([[0]], max_new, self.seed)
            except InputError as e:
                why = re.sub(r"^prompt 0 has 1 tokens", "a context of 1 token", str(e))
                raise InputError(f"generate_until: request {first} asks for max_gen_toks={max_new}, which leaves "
                                 f"no room for a context in mode {self.mode} ({why})") from None
            fits, too_long = 1, self.target.config.max_position_embeddings + 1
            while too_long - fits > 1:
                mid = (fits + too_long) // 2
                try:
                    runner.check([[0] * mid], max_new, self.seed)
                    fits = mid
                except InputError:
                    too_long = mid
            self._limits[key] = fits
        return self._limits[key]

    def _runner(self, stop_ids: tuple[int, ...], temperature: float = 0.0):
        """The mode's runner stopping at the model's EOS and `stop_ids`, sampling at `temperature` (0: greedy); one
        per setting, built once."""
        key = (stop_ids, temperature)
        if key not in self._runners:
            from parse_jax.harness.runs import mode_runner

            eos = None if not stop_ids else sorted({*self.eos_ids, *stop_ids})
            self._runners[key] = mode_runner(self.target, self.draft, self.config, self.mode, temperature,
                                             eos_ids=eos, honour_rounds=True)
        return self._runners[key]

    def _generate(self, runner, batch: list[int], ids: list[list[int]], max_new: int,
                  seeds: list[int]) -> tuple[list[str], list[set[str]]]:
        """(uncut texts, what the schedule ran for each) of a batch (requests `batch`, prompts `ids`) in one call of
        `runner` (a `_runner`): stop strings of one token end their row inside the device program (stop ids beside
        the EOS)."""
        with requests_named("generate_until", batch):
            res = runner(ids, max_new, seeds)
        self.stats_parts.append(res.stats)
        return res.texts, ran_each(res.stats, len(ids))

    def _generate_in_segments(self, runner, batch: list[int], ids: list[list[int]], max_new: int,
                              until: tuple[str, ...], stop_ids: tuple[int, ...],
                              seeds: list[int]) -> tuple[list[str], list[set[str]]]:
        """`_generate` for a batch whose `until` holds a stop string longer than one token: a row whose committed
        text holds one ends at the next check. Generation runs in segments of 16, 32, 64, ... tokens (at most
        log2(max_new) calls), each on the prompt and the ids committed so far, and only rows with no stop string,
        EOS or spent budget go on. Resuming is exact only where a call's output does not depend on where it starts
        (target, draft alone, sd, eagle3: the target's own tokens, `RESUMABLE`); PARSE modes run each batch in one
        call and cut after it (docs/design.md §8)."""
        tok = self.target.tokenizer
        done_ids = {*self.eos_ids, *stop_ids}
        gen: list[list[int]] = [[] for _ in ids]
        ran: list[set[str]] = [set() for _ in ids]
        live, segment = list(range(len(ids))), FIRST_SEGMENT
        while live:
            n = min(segment, max_new - len(gen[live[0]]))  # live rows have all committed the same count
            # each segment its own draws: a step's noise must not repeat at every segment's start
            with requests_named("generate_until", [batch[i] for i in live]):
                res = runner([ids[i] + gen[i] for i in live], n,
                             [(seeds[i] + 65537 * len(gen[i])) % (SEED_MAX + 1) for i in live])
            self.stats_parts.append(res.stats)
            for i, names in zip(live, ran_each(res.stats, len(live))):
                ran[i] |= names
            still = []
            for i, new in zip(live, res.tokens):
                gen[i] += list(new)
                ended = len(new) < n or (new and new[-1] in done_ids) or len(gen[i]) >= max_new
                if not ended and not any(s in tok.decode(gen[i]) for s in until):
                    still.append(i)
            live, segment = still, segment * 2
        return [tok.decode(g) for g in gen], ran

    def speculation_stats(self) -> dict:
        """The speculation stats of every generation so far: counts summed, the field's rates derived, and under
        `schedule="auto"` how many requests each choice ran (`schedule_ran`, as `parse-jax eval` counts its records:
        "target" is plain decoding); `scored_requests`: loglikelihood(_rolling) requests, scored on the target
        alone."""
        totals = {k: sum(p.get(k, 0) for p in self.stats_parts) for k in SUMMED if any(k in p for p in
                                                                                        self.stats_parts)}
        out = {"mode": self.mode, "batches": len(self.stats_parts), **totals, **combine(self.stats_parts)}
        if self.schedule_ran:
            out["schedule_ran"] = dict(sorted(self.schedule_ran.items()))
        if self.scored:
            out["scored_requests"] = self.scored
        return out

    def _write_stats(self) -> None:
        if self.stats_path is not None:
            from parse_jax.utils.atomic import write_json

            write_json(self.stats_path, self.speculation_stats())

    def get_model_info(self) -> dict:
        return {"parse_jax_mode": self.mode, "parse_jax_models": self.models,
                "parse_config": json.loads(json.dumps(self.config.flat(), default=str)),
                "speculation_stats": self.speculation_stats()}

    # --- chat templates (lm-eval's --apply_chat_template) ----------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        """The target tokenizer's folder, as lm-eval's HF model names it (its request cache keys on it)."""
        return str(self.target.tokenizer.source).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The target tokenizer's chat template where lm-eval asks for one; a target without one is refused here,
        before any request (a named template other than the folder's default is refused too)."""
        if not chat_template:
            return None
        template = self.target.tokenizer.chat_template
        if template is None:
            raise ConfigError(f"--apply_chat_template: the target's tokenizer ({self.target.tokenizer.source}) has "
                              "no chat template (tokenizer_config.json, chat_template.jinja, chat_template.json)")
        if isinstance(chat_template, str) and chat_template not in ("default", "True", "true"):
            raise ConfigError(f"--apply_chat_template {chat_template!r}: parse-jax reads the folder's default "
                              "template only; give the flag without a name")
        return template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's chat history as the target's template writes it, as lm-eval's HF model renders it: a template
        that refuses a system message gets the history without it, and without a generation prompt the final
        (assistant) message is left open for the model to continue (transformers' `continue_final_message`)."""
        tok = self.target.tokenizer
        try:
            text = tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                           **self.chat_template_args)
        except InputError:  # the template raised on the messages: lm-eval's HF model drops the system role
            chat_history = [m for m in chat_history if m.get("role") != "system"]
            text = tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                           **self.chat_template_args)
        if add_generation_prompt or not chat_history:
            return text
        return open_final_message(text, str(chat_history[-1].get("content", "")))

    # --- scoring on the target ---------------------------------------------------------------------------

    def _prefix_id(self) -> int | None:
        """lm-eval's HF model's `prefix_token_id`: the BOS, else the EOS (None: neither); what an empty context and a
        document's first rolling window condition on."""
        tok = self.target.tokenizer
        first = tok.bos_id if tok.bos_id is not None else tok.eos_id
        return None if first is None else int(first)

    def _score(self, context: list[int], continuation: list[int], index: int) -> tuple[float, bool]:
        """log p(continuation | context) on the target and whether greedy decoding writes it. As lm-eval's HF model
        scores: the last token is never fed (nothing reads its logits) and a context longer than the target's
        positions is cut from the left, so a rolling window of `max_length` + 1 tokens fits."""
        if not continuation:
            return 0.0, True
        width = self.target.config.max_position_embeddings
        if len(continuation) > width:
            raise InputError(f"loglikelihood: request {index} has a continuation of {len(continuation)} tokens, "
                             f"longer than the target's {width} positions")
        fed = (context + continuation)[-(width + 1):][:-1]
        length = min(-(-len(fed) // 16) * 16, width)  # right padding to a multiple of 16: fewer shapes to compile
        ids = np.zeros((1, length), np.int64)
        ids[0, : len(fed)] = fed
        logits = np.asarray(self.target.logits(ids), np.float64)[0, len(fed) - len(continuation): len(fed)]
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        cont = np.asarray(continuation)
        return float(logp[np.arange(len(cont)), cont].sum()), bool((logits.argmax(-1) == cont).all())

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out, prefix = [], self._prefix_id()
        for i, req in enumerate(requests):
            try:
                pair = encode_pair(self.target.tokenizer, *req.args, prefix)
            except InputError as e:
                raise InputError(f"loglikelihood: request {i}: {e}") from None
            out.append(self._score(*pair, i))
        self.scored += len(requests)
        self._write_stats()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        tok, out, prefix = self.target.tokenizer, [], self._prefix_id()
        if prefix is None:
            raise InputError(f"loglikelihood_rolling: {no_prefix_token(tok)}")
        width = self.target.config.max_position_embeddings
        for i, req in enumerate(requests):
            (text,) = req.args
            # as lm-eval's HF model: the document as the tokenizer writes it by default (its BOS, where its
            # post-processor adds one), after the prefix token (so a BOS-adding tokenizer's first window holds two)
            windows = get_rolling_token_windows(token_list=tok.encode_prompt(text), max_seq_len=width, context_len=1,
                                                prefix_token=prefix)
            total = 0.0
            for window in map(make_disjoint_window, windows):
                context, continuation = list(window[0]), list(window[1])
                total += self._score(context, continuation, i)[0]
            out.append(total)
        self.scored += len(requests)
        self._write_stats()
        return out


@contextlib.contextmanager
def requests_named(where: str, index: list[int]):
    """Errors of a batch inside, naming its row ("prompt 3"), as the request of the lm-eval call that row holds
    (`index[3]`)."""
    try:
        yield
    except ParseJaxError as e:
        message, n = re.subn(r"\bprompt (\d+)\b", lambda m: f"request {index[int(m.group(1))]}"
                             if int(m.group(1)) < len(index) else m.group(0), str(e))
        if not n:
            raise
        raise type(e)(f"{where}: {message}") from None


def ran_each(stats: dict, n: int) -> list[set[str]]:
    """What `schedule="auto"` ran for each of a call's `n` rows (empty sets where nothing was scheduled)."""
    from parse_jax.harness.runs import ran_per_prompt

    return [{name} for name in ran_per_prompt(stats, n) or []] or [set() for _ in range(n)]


def stop_strings(until: Any) -> tuple[str, ...]:
    """A request's `until` (a string, a list of them or None) as a tuple of its non-empty stop strings."""
    stops = [until] if isinstance(until, str) else list(until or [])
    if any(not isinstance(s, str) for s in stops):
        raise ConfigError(f"generate_until: until must be a string or a list of strings, got {until!r}")
    return tuple(s for s in stops if s)


def new_token_budget(kwargs: dict[str, Any], default: int) -> int:
    """A request's new-token budget under lm-eval's names for it, in lm-eval's priority (`normalize_gen_kwargs`:
    max_gen_toks > max_new_tokens > max_tokens > max_completion_tokens); `default` where none is given."""
    given = [(name, kwargs[name]) for name in BUDGET_NAMES if kwargs.get(name) is not None]
    if not given:
        return default
    name, value = given[0]
    return check_int(f"generate_until: {name}", int(value) if isinstance(value, str) and value.isdigit() else value, 1)


def sampling_temperature(kwargs: dict[str, Any]) -> float:
    """The temperature a request's generation kwargs ask for, as lm-eval's HF model reads them: `do_sample` false
    (or absent with temperature 0, lm-eval's default) is greedy; `do_sample` true samples at `temperature` (default
    1: transformers' own, where lm-eval's HF model passes 0 and transformers refuses it). When sampling, top_k /
    top_p other than off are refused: the engine's programs here take a temperature only."""
    do_sample = kwargs.get("do_sample")
    temperature = check_float("generate_until: temperature", kwargs.get("temperature", 1.0 if do_sample else 0.0),
                              0.0)
    temperature = 0.0 if do_sample is False else temperature
    refused = {**UNSUPPORTED, **(UNSUPPORTED_WHEN_SAMPLING if temperature > 0 else {})}  # greedy ignores sampling's
    for name, off in refused.items():
        if kwargs.get(name) not in off:
            raise ConfigError(f"generate_until: {name}={kwargs[name]!r} is not supported by the parse-jax model "
                              "(temperature and do_sample are)")
    unknown = sorted(k for k in kwargs if k not in READ)
    if unknown:
        _warn_once(f"generate_until: ignoring generation kwargs the parse-jax model does not read: "
                   f"{', '.join(unknown)}")
    return temperature


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        from parse_jax.utils.progress import logger

        logger.warning(message)


def open_final_message(text: str, final: str) -> str:
    """`text` cut right after the final message's content, as transformers' `continue_final_message` cuts it: the
    message's trailing spaces kept where the template kept them, a message the template does not write refused."""
    if final.strip() not in text:
        raise InputError("--apply_chat_template: the chat template does not write the final (assistant) message as "
                         "given, so it cannot be left open for the model to continue")
    at = text.rindex(final.strip())
    kept = len(final.lstrip())
    return text[: at + kept] if text[at: at + kept] == final else text[: at + len(final.strip())]


def encode_pair(tok, context: str, continuation: str, prefix_id: int | None = None) -> tuple[list[int], list[int]]:
    """A loglikelihood request's ids as lm-eval's HF model encodes them (`TemplateLM.loglikelihood` and
    `_encode_pair`, causal): the context's trailing spaces move into the continuation; context and whole are
    encoded as the tokenizer writes them by default (`encode_prompt`: a BOS where its post-processor adds one,
    none for Qwen's), and the continuation is what the whole adds past the context's ids (a token that spans the
    join is the continuation's). An empty context is `prefix_id` (lm-eval's `prefix_token_id`), unless the
    continuation starts with that token; so is a context of spaces alone on a tokenizer that adds no BOS (it
    encodes to nothing, and the first token needs one before it)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    head = tok.encode_prompt(context) if context else []
    if not head:
        if prefix_id is None:
            raise InputError(f"an empty context: {no_prefix_token(tok)}")
        ids = tok.encode(continuation)
        return ([prefix_id], ids) if ids[:1] != [prefix_id] else (ids[:1], ids[1:])
    return head, tok.encode_prompt(context + continuation)[len(head):]


def no_prefix_token(tok) -> str:
    """Why a request that needs lm-eval's prefix token cannot have one."""
    return (f"needs a token to condition on and the target's tokenizer names no BOS or EOS ({tok.source}): add "
            "bos_token or eos_token to its tokenizer_config.json")


def single_token_stops(tok, until: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the stop strings that are one token of `tok` (special tokens included): stop ids of the device
    program, as EOS is."""
    out = set()
    for s in until:
        ids = tok.encode(s)
        if len(ids) == 1 and tok.decode(ids, keep_special=True) == s:
            out.add(int(ids[0]))
    return tuple(sorted(out))


def main() -> None:
    """`parse-jax-lm-eval ARGS`: lm-eval's command line (`lm-eval run --model parse-jax ...`) with parse-jax
    registered."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except ParseJaxError as e:  # bad model_args or requests: one line, as every parse-jax command says it
        print(f"parse-jax-lm-eval: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
