"""What a generation request is, whatever the mode: sampling settings, prompts as token ids (text through the
tokenizer), the stop ids, and the result every mode returns."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import struct

from parse_jax.errors import InputError
from parse_jax.runtime.metrics import COUNTS, LIST_COUNTS, add_counts, derived
from parse_jax.runtime.sampling import Sampler, SamplingArgs, row_keys, unread_keys
from parse_jax.utils.progress import logger
from parse_jax.utils.validation import SEED_MAX, check_float, check_int, check_seed, check_text, shorten

PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated generation request (`ParseEngine.request`): prompts as ids, budget, sampling, stop ids."""

    ids: list[list[int]]
    max_new: int     # the largest budget: what the programs' shapes are made for
    sampling: SamplingParams
    eos: np.ndarray  # int32 stop ids ([-1] for none)
    budgets: tuple[int, ...] | None = None  # each prompt's own max_new_tokens (None: `max_new` for every one)

    def budget_list(self) -> list[int]:
        """Each prompt's max_new_tokens."""
        return list(self.budgets) if self.budgets is not None else [self.max_new] * len(self.ids)

    def rows(self, start: int, stop: int) -> Request:
        """Prompts [start, stop) as a request of their own: each keeps its seed and budget (the shapes those need)."""
        budgets = None if self.budgets is None else self.budgets[start:stop]
        return dataclasses.replace(self, ids=self.ids[start:stop], sampling=self.sampling.rows(start, stop),
                                   budgets=budgets, max_new=self.max_new if budgets is None else max(budgets))


def check_budgets(max_new_tokens, n: int) -> tuple[int, tuple[int, ...] | None]:
    """`max_new_tokens` for `n` prompts: one budget (>= 1) or one per prompt -> (the largest, the list or None)."""
    if per_prompt(max_new_tokens):
        if len(max_new_tokens) != n:
            raise InputError(f"max_new_tokens: {len(max_new_tokens)} budgets for {n} prompts; give one, or one per "
                             "prompt")
        for i, b in enumerate(max_new_tokens):
            if per_prompt(b) or isinstance(b, dict):
                raise InputError(f"max_new_tokens[{i}] must be an integer >= 1, got a {type(b).__name__}")
        budgets = tuple(check_int(f"max_new_tokens[{i}]", b, 1, error=InputError) for i, b in enumerate(max_new_tokens))
        return max(budgets), budgets
    return check_int("max_new_tokens", max_new_tokens, 1, error=InputError), None


@dataclasses.dataclass
class GenerationStats:
    """What a generation did, in every mode (None: not meaningful in that mode). `GenerateResult.stats` is
    `as_dict()` of it: counts and seconds (docs/design.md §3)."""

    new_tokens: int
    seconds: float
    target_passes: int                  # target forward passes (prefill, verification, decode steps)
    request_passes: int | None = None   # passes summed over requests (a request sits through the ones it is in)
    verify_passes: int | None = None
    rounds: int | None = None           # multi-round PARSE / speculation rounds
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    accepted_per_request: list[int] | None = None
    prefixes_per_request: list[int] | None = None
    verify_tokens: int | None = None    # real tokens in verification blocks
    continued_requests: int | None = None
    continue_batch: int | None = None   # the batch the continuation ran at (0: none)
    acceptance_rate: float | None = None
    gamma: int | None = None
    eagle3_accepted_tokens: int | None = None
    eagle3_draft_tokens: int | None = None
    eagle3_num_drafts: int | None = None  # parse+eagle3: EAGLE-3 drafts its continuation verified
    # the field's metrics (parse_jax/runtime/metrics.py): raw counts here, the rates derived in as_dict()
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    num_accepted_tokens_per_pos: list[int] | None = None
    drafts_per_request: list[int] | None = None
    num_steps_drafted: int | None = None
    num_verifications: int | None = None
    first_rejected_step_hist: list[int] | None = None
    accepted_score_hist: list[int] | None = None
    rejected_score_hist: list[int] | None = None

    def as_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        out["tokens_per_s"] = self.new_tokens / self.seconds if self.seconds > 0 else float("inf")
        if self.accepted_tokens is not None:
            out["accepted_per_pass"] = self.accepted_tokens / max(self.verify_passes or self.target_passes, 1)
        out.update(derived(out))
        return out


@dataclasses.dataclass
class GenerateResult:
    texts: list[str]
    tokens: list[list[int]]
    stats: dict


def per_prompt(value: Any) -> bool:
    """Whether a setting is given per prompt (a list, tuple or 1-d array), not once for the call."""
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes))) or \
        (isinstance(value, np.ndarray) and value.ndim > 0)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """`seed`: one seed for the call, prompt i drawing from `seed + i` (mod 2**31), or one seed per prompt (a list):
    a prompt's draws depend on its own seed only, never on its batch."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | tuple[int, ...] = 0

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        fix("temperature", check_float("temperature", self.temperature, 0.0, error=InputError))
        fix("top_k", check_int("top_k (0 = off)", self.top_k, 0, error=InputError))
        fix("top_p", check_float("top_p", self.top_p, 0.0, 1.0, min_open=True, error=InputError))
        if per_prompt(self.seed):
            if len(self.seed) == 0:
                raise InputError("seed: an empty list; give one seed, or one per prompt")
            fix("seed", tuple(check_seed(f"seed[{i}]", s, error=InputError) for i, s in enumerate(self.seed)))
        else:
            fix("seed", check_seed("seed", self.seed, error=InputError))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sampler(self) -> Sampler:
        """The static half a program is compiled for."""
        return Sampler(greedy=self.greedy, top_k=self.top_k)

    def seeds(self, start: int, stop: int) -> tuple[int, ...]:
        """The seeds of prompts [start, stop) (past a per-prompt list: 0, a padding row's)."""
        if isinstance(self.seed, tuple):
            return self.seed[start:stop] + (0,) * max(stop - max(start, len(self.seed)), 0)
        return tuple((self.seed + i) % (SEED_MAX + 1) for i in range(start, stop))

    def rows(self, start: int, stop: int) -> SamplingParams:
        """The settings of prompts [start, stop) as a call of their own (each keeps its seed)."""
        return dataclasses.replace(self, seed=self.seeds(start, stop))

    def keys(self, rows: int) -> np.ndarray:
        """[rows, 2] each row's key (`PRNGKey` of its seed); zeros when greedy (unread)."""
        if self.greedy:
            return unread_keys(rows)
        return row_keys(self.seeds(0, rows))

    def check_prompts(self, n: int) -> None:
        """A per-prompt seed list names one seed for each of the call's `n` prompts."""
        if isinstance(self.seed, tuple) and len(self.seed) != n:
            raise InputError(f"seed: {len(self.seed)} seeds for {n} prompts; give one seed, or one per prompt")

    def args(self, rows: int) -> SamplingArgs:
        """The traced half (one program serves every value) for a batch of `rows` rows (padding included), each
        keyed by its prompt's seed; temperature is floored away from 0, where greedy programs ignore it."""
        return SamplingArgs(temperature=np.float32(max(self.temperature, 1e-6)), top_p=np.float32(self.top_p),
                            key=self.keys(rows))


_WARNED_UNWRITABLE: weakref.WeakSet = weakref.WeakSet()  # tokenizers whose unwritable prompts were reported


def encode_prompts(model, prompts: Sequence[str] | Sequence[Sequence[int]], add_bos: bool = True) -> list[list[int]]:
    """Text prompts through the tokenizer as transformers encodes them (`Tokenizer.encode_prompt`: its BOS where its
    post-processor adds one; `add_bos=False`: the text's own ids only); id lists as given."""
    if isinstance(prompts, (str, bytes)):
        raise InputError("prompts must be a list of strings or of token-id lists, not a single string")
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise InputError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InputError("no prompts given")
    if not isinstance(add_bos, (bool, np.bool_)):
        raise InputError(f"add_bos must be True or False, got {shorten(repr(add_bos))}")
    if any(not isinstance(p, (str, Sequence, np.ndarray)) or isinstance(p, bytes) for p in prompts):
        kinds = sorted({type(p).__name__ for p in prompts})
        raise InputError(f"prompts must be a list of strings or of token-id lists (a batch: [[1, 2, 3]], not "
                         f"[1, 2, 3]), got items of type {', '.join(kinds)}")
    out, unwritable = [], []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise InputError("text prompts need a tokenizer; this model has none (pass token ids)")
            text = check_text(f"prompt {i}", p)
            own = model.tokenizer.encode(text)
            if not own:
                raise InputError(f"prompt {i} is empty (no tokens)")
            has_unknown = getattr(model.tokenizer, "has_unknown", None)
            if has_unknown is not None and has_unknown(own):
                unwritable.append((p, [int(t) for t in own].index(model.tokenizer.unk_id)))
            ids = model.tokenizer.encode_prompt(text) if add_bos else own
        else:
            ids = [check_int(f"prompt {i} token {j}", t, error=InputError) for j, t in enumerate(p)]
        if not ids:
            raise InputError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise InputError(f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}")
        out.append(ids)
    if unwritable and model.tokenizer not in _WARNED_UNWRITABLE:
        # encoded as transformers encodes it, but the model reads its unknown token there: said (once per tokenizer
        # and process: an eval checks its records one by one), never silent
        _WARNED_UNWRITABLE.add(model.tokenizer)
        p, at = unwritable[0]
        logger.warning(f"prompt text this tokenizer's vocabulary cannot write: the model reads its unknown token "
                       f"there (first seen: {shorten(p)!r}, at token {at} of its text); rewrite such prompts in the "
                       "vocabulary's words or pass token ids (said once)")
    return out


def resolve_eos(model, eos_ids: Sequence[int] | None = None) -> np.ndarray:
    """Stop ids as an int32 array: `eos_ids` if given ([] = none), else the config's and tokenizer's EOS."""
    if eos_ids is None:
        tok_eos = getattr(model.tokenizer, "eos_id", None)
        eos_ids = [*model.config.eos_token_ids, *([tok_eos] if tok_eos is not None else [])]
    return np.array(sorted({int(x) for x in eos_ids}) or [-1], np.int32)


def pad_prompts(ids: list[list[int]], batch: int, length: int, max_new_tokens: int | Sequence[int]):
    """Right-padded prompts [batch, length], their lengths, and each row's budget (`max_new_tokens`: one for every
    prompt, or each its own; 0 for padding rows)."""
    prompt = np.full((batch, length), PAD_ID, np.int32)
    lens = np.ones((batch,), np.int32)
    max_new = np.zeros((batch,), np.int32)
    budgets = [max_new_tokens] * len(ids) if np.ndim(max_new_tokens) == 0 else max_new_tokens
    for i, x in enumerate(ids):
        prompt[i, : len(x)] = x
        lens[i] = len(x)
        max_new[i] = budgets[i]
    return prompt, lens, max_new


@struct.dataclass
class Prompts:
    """A request's rows as a program takes them: right-padded prompt ids [B, P], their lengths [B] and each row's
    budget [B] (0 for padding rows)."""

    tokens: Any
    lens: Any
    max_new: Any


def device_prompts(model, ids: list[list[int]], batch: int, length: int,
                   max_new_tokens: int | Sequence[int]) -> Prompts:
    """`pad_prompts`, placed as `model` places request rows (over `data` when it is sharded)."""
    tokens, lens, max_new = (model.place_rows(x) for x in pad_prompts(ids, batch, length, max_new_tokens))
    return Prompts(tokens=tokens, lens=lens, max_new=max_new)


# counts that add up over batches; lists that concatenate in prompt order
_SUMMED = ("new_tokens", "seconds", "target_passes", "request_passes", "verify_passes", "rounds", "draft_tokens",
           "accepted_tokens", "verify_tokens", "continued_requests", "eagle3_accepted_tokens", "eagle3_draft_tokens",
           "eagle3_num_drafts", "admissions", "parked")
_JOINED = ("accepted_per_request", "prefixes_per_request", "drafts_per_request", "checks_per_request")


def merge_results(parts: Sequence[GenerateResult]) -> GenerateResult:
    """One result of several batches of a request, in their order: texts and tokens joined, counts added (a count
    only some batches report is kept for those), rates recomputed; `batches` says how many ran."""
    stats: dict[str, Any] = {}
    for part in parts:
        add_counts(stats, part.stats)  # the field's metrics' counts (lists elementwise)
        for key, value in part.stats.items():
            if key in LIST_COUNTS or key in COUNTS:
                continue
            if key in _SUMMED:
                stats[key] = stats.get(key, 0) + value
            elif key in _JOINED:
                continue  # joined below, in prompt order
            elif key not in stats:
                stats[key] = value
    for key in _JOINED:  # a batch that ran without speculation (schedule auto) has none: zeros for its requests
        if any(key in p.stats for p in parts):
            stats[key] = [x for p in parts for x in (list(p.stats[key]) if key in p.stats else [0] * len(p.tokens))]
    # per request, a batched pass counts once for each row it carried (a part that does not say: all its rows)
    stats["request_passes"] = sum(p.stats.get("request_passes", p.stats.get("target_passes", 0) * len(p.tokens))
                                  for p in parts)
    stats["request_checks"] = sum(p.stats.get("request_checks", p.stats.get(
        "verify_passes", p.stats.get("target_passes", 0)) * len(p.tokens)) for p in parts)
    stats["tokens_per_s"] = stats["new_tokens"] / stats["seconds"] if stats.get("seconds") else float("inf")
    if "accepted_tokens" in stats:
        stats["accepted_per_pass"] = stats["accepted_tokens"] / max(stats.get("verify_passes")
                                                                    or stats["target_passes"], 1)
    if "acceptance_rate" in stats and stats.get("draft_tokens"):  # accepted of proposed, over every batch
        stats["acceptance_rate"] = stats["accepted_tokens"] / stats["draft_tokens"]
    if "continue_batch" in stats:  # the largest batch a continuation ran at
        stats["continue_batch"] = max(part.stats.get("continue_batch") or 0 for part in parts)
    stats.update(derived(stats))
    stats["batches"] = sum(part.stats.get("batches", 1) for part in parts)
    return GenerateResult(texts=[t for p in parts for t in p.texts], tokens=[t for p in parts for t in p.tokens],
                          stats=stats)
