"""ParseEngine: one target/draft pair (and optionally the target's EAGLE-3 head), every generation mode over it.

The modes live in `parse_jax/modes/`, one module each, described by `parse_jax.modes.table.MODE_TABLE`; the engine
validates a request once (prompts, sampling, budget, cache and position limits, before anything is allocated), and
runs it as `spec.runner(self.context, request)` over the typed `ModeContext` it built once. See docs/design.md §4
for the module map.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from parse_jax.distributed.mesh import check_mesh
from parse_jax.distributed.sharded import kernel_context, replicate, shard_model
from parse_jax.distributed.verify import sharded_score_prefixes
from parse_jax.errors import ConfigError, InputError
from parse_jax.lowering.memory import MemoryGuard
from parse_jax.models.vocab import align_vocab
from parse_jax.modes.context import ModeContext
from parse_jax.modes.table import MODE_TABLE
from parse_jax.runtime.programs import FETCHES, bucket, compiled_programs, length_bucket, setup_events, setup_split
from parse_jax.runtime.requests import (
    GenerateResult,
    Request,
    SamplingParams,
    check_budgets,
    encode_prompts,
    merge_results,
    per_prompt,
    resolve_eos,
)
from parse_jax.schedule.auto import (
    EXPLORE_FILLS,
    EXPLORE_MIN_PROMPTS,
    Outlook,
    ScheduleChoice,
    ScheduleState,
    SetupCharge,
    choose,
)
from parse_jax.schedule.auto import PLAIN as PLAIN_CHOICE
from parse_jax.schedule.auto import option as choice_name
from parse_jax.schedule.costs import PassCosts
from parse_jax.schedule.policy import Knobs, Workload
from parse_jax.schedule.prefix_price import prefix_price
from parse_jax.schedule.profile import pass_costs
from parse_jax.schedule.setup import SetupCosts, ledger, load_setup_costs
from parse_jax.settings import MODES, Eagle3Settings, Mode, ParseConfig, SpecSettings, check_config  # noqa: F401  (re-exported)
from parse_jax.speculation.draft_model import check_pair
from parse_jax.speculation.eagle3 import Eagle3, check_head, check_tree
from parse_jax.tasks import JUDGE_NO, JUDGE_YES, VERIFY_SUFFIX
from parse_jax.utils.progress import logger
from parse_jax.utils.validation import (
    check_boundaries,
    check_choice,
    check_eos_ids,
    check_float,
    check_int,
    check_model,
)
from parse_jax.verify.host_segment import (
    cap_boundaries,
    confidence_boundaries,
    hybrid_from_boundaries,
    stride_boundaries,
    text_delimiter_boundaries,
    value_boundaries,
)
from parse_jax.verify.round import Judge, RoundSpec
from parse_jax.verify.scoring import judge_ids, score_prefixes
from parse_jax.verify.segment import DelimiterTable


def chat_suffix(tokenizer, question: str) -> list[int]:
    """The verification suffix of a chat model: what its chat template writes after an assistant turn (the draft)
    when a user turn asks `question` and the assistant is to answer (Qwen3: with thinking off), as ids."""
    marker = "\x00PARSE-DRAFT\x00"
    messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker},
                {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    if text.count(marker) != 1:
        raise ConfigError("the chat template does not write the assistant's turn as given: cannot place the "
                          "verification suffix after the draft (use suffix_format='plain')")
    suffix = text.split(marker, 1)[1]
    ids = [int(t) for t in tokenizer.encode(suffix)]
    if not ids:
        raise ConfigError("the chat template writes nothing after the assistant's turn")
    return ids


class ParseEngine:
    """PARSE and its baselines over one target/draft pair. `eagle3`: an EAGLE-3 head for the target (modes
    `eagle3` and `parse+eagle3`); by default the head that came with the target (`pj.load_pair()` attaches the
    embedded pair's). `draft` may be None for the modes that need none (target, eagle3)."""

    def __init__(self, target, draft, config: ParseConfig | None = None, eagle3: Eagle3 | None = None,
                 mesh: Mesh | None = None) -> None:
        check_model("target", target)
        if draft is not None:
            check_model("draft (or None)", draft)
        check_config(config)
        check_mesh(mesh)
        self.config = config or ParseConfig()
        eagle3 = eagle3 if eagle3 is not None else target.eagle3
        if eagle3 is not None:  # a head loaded alone meets its target here: checked, in the target's dtype (the
            # target it was trained for: before a draft with more embedding rows pads it, which the head reads
            # through the target's own embedding and LM head, or maps into with its d2t)
            eagle3 = check_head("eagle3", eagle3).for_target(target.config)
        if draft is not None:  # one tokenizer, embeddings padded differently: pad the smaller, mask its padding
            target, draft = align_vocab(target, draft)
            check_pair(target, draft)
        if mesh is not None:  # weights over `model`, requests over `data` (see parse_jax.distributed)
            target = shard_model(target, mesh)
            draft = shard_model(draft, mesh, fallback_replicated=True) if draft is not None else None
        if eagle3 is not None and target.mesh is not None:  # the head runs beside the sharded target: replicate it
            eagle3 = dataclasses.replace(eagle3, params=replicate(eagle3.params, target.mesh))
        self.target, self.draft, self.eagle3 = target, draft, eagle3
        tok = target.tokenizer
        if tok is None:
            raise ConfigError("the target has no tokenizer: the suffix and judge words cannot be encoded")
        cfg = self.config
        # said once, where the judge first runs: a valid request of a mode that judges (target, sd and eagle3 never
        # read these settings) or prefix_scores
        self._settings_warning = (
            f"the target is a chat model but the PARSE settings are the embedded task's defaults (suffix "
            f"{VERIFY_SUFFIX!r}, judge words {JUDGE_YES!r}/{JUDGE_NO!r}): its scores will not mean much; pass a "
            "ParseConfig for the model (e.g. --parse-config qwen3_chat)"
            if tok.chat_template and cfg.suffix_format == "plain"
            and (cfg.verify_suffix, cfg.judge_yes, cfg.judge_no) == (VERIFY_SUFFIX, JUDGE_YES, JUDGE_NO) else None)
        if cfg.suffix_format == "chat" and not tok.chat_template:
            raise ConfigError("suffix_format='chat' writes the verification suffix with the target's chat template, "
                              "and its tokenizer has none; use suffix_format='plain' (a chat config such as "
                              "qwen3_chat is for chat models)")
        self.suffix_ids = (chat_suffix(tok, cfg.verify_suffix) if cfg.suffix_format == "chat"
                           else self._encode_setting("verify_suffix", cfg.verify_suffix))
        self.yes_id, self.no_id, shared = judge_ids(tok, cfg.judge_yes, cfg.judge_no)
        self.suffix_ids = self.suffix_ids + shared  # the judge words' common first tokens, then where they part
        v = target.config.vocab_size
        if cfg.segmenter != "stride":
            self.delimiters = DelimiterTable.from_texts(tok.token_texts, cfg.delimiters, v)
            table = self.delimiters.table
            self.step_end_ids = self.delimiters.completing_ids()  # multi round: the target stops there
        else:
            self.delimiters, table, self.step_end_ids = None, np.zeros((1, v), np.int32), np.zeros(0, np.int32)
        self.judge = Judge(suffix=jnp.asarray(self.suffix_ids, jnp.int32), yes_id=jnp.int32(self.yes_id),
                           no_id=jnp.int32(self.no_id), threshold=jnp.float32(cfg.threshold),
                           table=jnp.asarray(table), prefix_price=jnp.float32(0.0))
        self.round_spec = RoundSpec(cfg.segmenter, cfg.max_prefixes, cfg.stride, cfg.min_segment, cfg.max_segment,
                                    cfg.policy, cfg.prefix_choice, cfg.prefix_confidence)
        self.context = ModeContext(target=target, draft=draft, head=eagle3, config=cfg.resolved(), judge=self.judge,
                                   round_spec=self.round_spec, suffix_ids=tuple(self.suffix_ids),
                                   step_end_ids=self.step_end_ids)
        # the context a batch runs with each rounds `schedule="auto"` may choose (built once: one object per rounds)
        self._contexts = {r: self.context if r == self.context.config.rounds else
                          dataclasses.replace(self.context, config=self.context.config.resolved(r))
                          for r in ("multi", "single")}
        self.schedule_state = ScheduleState()  # schedule="auto": acceptance and costs measured so far
        self.memory_guard = MemoryGuard()  # generate's memory plan on the first device (docs/lowering.md)
        self._costs: PassCosts | None = None
        self._setup: SetupCosts | None = None  # program setup per choice, read from disk when first needed
        self._job_left: int | None = None  # prompts left in a one-off job (`job`); None: setup is not charged
        self._prompts_run = 0  # prompts this engine has generated for (`_windows_after`)
        self._row_tokens: float | None = None  # tokens a row has written on average so far

    @contextlib.contextmanager
    def job(self, prompts: int) -> Iterator[ParseEngine]:
        """Declare the next `prompts` prompts (over any number of `generate` calls) a one-off job, as `parse-jax eval`
        does: under `schedule="auto"`, each choice's program setup (tracing, compiling, loading; measured by earlier
        runs and remembered on disk) is charged to the job's remaining rows, and a choice whose setup they cannot
        pay back is neither run nor explored. Outside a job, setup is amortized over the engine's life (a server, a
        benchmark) and not charged. docs/design.md §7."""
        prompts = check_int("prompts", prompts, 1, error=InputError)
        outer, self._job_left = self._job_left, prompts
        try:
            yield self
        finally:
            self._job_left = outer

    def _encode_setting(self, name: str, text: str) -> list[int]:
        """A setting's text as ids, special tokens in it (`<|im_end|>`, `<|eot_id|>`: a hand-written chat turn) as
        the model's special ids, as transformers encodes them. Text the tokenizer cannot write back is refused:
        unknown characters (the unknown token), or ids that do not survive a round trip keeping special tokens."""
        tok = self.target.tokenizer
        ids = [int(t) for t in tok.encode(text)]
        if not ids:
            raise ConfigError(f"{name} {text!r} encodes to no tokens")
        if tok.has_unknown(ids):
            raise ConfigError(f"{name} {text!r} is not in this tokenizer's vocabulary (it encodes to the unknown "
                              "token)")
        back = tok.decode(ids, keep_special=True)
        # spacing may differ (word-level vocabularies); the ids must come back the same
        if "".join(back.split()) != "".join(text.split()) or [int(t) for t in tok.encode(back)] != ids:
            raise ConfigError(f"{name} {text!r} cannot be written in this tokenizer's vocabulary (it encodes to "
                              f"{ids}, which decode to {back!r})")
        return ids

    # --- segmentation and scoring (the numpy reference path) ------------------------------------------------

    def boundaries(self, draft_ids: Sequence[int], probs: Sequence[float] | None = None) -> list[int]:
        """Candidate prefix ends of a draft by the configured segmenter, capped at max_prefixes (the numpy
        reference of the device segmenter: delimiters are found in the decoded text of the draft's tokens).
        `probs`: the draft's probability of each of its tokens, which `prefix_choice` "confidence" and "auto" choose
        by. Under "auto" the price is one request's alone with no context before the draft; `generate` prices at
        its batch and its prompts' length, so its choice can differ."""
        cfg = self.config
        draft = self._ids("draft_ids", draft_ids)
        if cfg.segmenter == "stride":
            b = stride_boundaries(len(draft), cfg.stride)
        else:
            texts = self.target.tokenizer.token_texts
            b = text_delimiter_boundaries([texts[t] if t < len(texts) else "" for t in draft], cfg.delimiters)
            if cfg.segmenter == "hybrid":
                b = hybrid_from_boundaries(b, len(draft), cfg.min_segment, cfg.max_segment)
        if cfg.prefix_choice == "spread":
            return cap_boundaries(b, cfg.max_prefixes)
        if probs is None or len(probs) != len(draft):
            raise InputError(f"prefix_choice {cfg.prefix_choice!r} chooses by the draft's token probabilities: pass "
                             f"probs, one per draft token ({len(draft)}), got {None if probs is None else len(probs)}")
        probs = [check_float(f"probs[{i}]", p, 0.0, 1.0, error=InputError) for i, p in enumerate(probs)]
        if cfg.prefix_choice == "auto":  # priced as for one request alone whose cache holds just this draft
            price = prefix_price(self._cost_model(), batch=1, draft_tokens=len(draft),
                                 suffix_tokens=len(self.suffix_ids),
                                 cache_len=length_bucket(len(draft) + 2 * len(self.suffix_ids)))
            return value_boundaries(b, probs, cfg.max_prefixes, cfg.prefix_confidence, price)
        return confidence_boundaries(b, probs, cfg.max_prefixes, cfg.prefix_confidence)

    def prefix_scores(self, context_ids: Sequence[int], draft_ids: Sequence[int],
                      boundaries: Sequence[int]) -> np.ndarray:
        """Judge score of each prefix draft[:b_k] after the context, from ONE target pass (the block packed and
        scored on the device by the code the modes run; over `data` by `shard_map` when the target is sharded)."""
        context, draft = self._ids("context_ids", context_ids), self._ids("draft_ids", draft_ids)
        bounds = check_boundaries(boundaries, len(draft))
        self.check_block_positions(len(context), len(draft))
        self._warn_settings()
        seqs, ends = [context + draft], [[len(context) + b for b in bounds]]
        if self.target.mesh is not None:
            return sharded_score_prefixes(self.target, seqs, ends, suffix=self.suffix_ids, yes_id=self.yes_id,
                                          no_id=self.no_id, mesh=self.target.mesh)[0]
        return score_prefixes(self.target, seqs, ends, suffix=self.suffix_ids, yes_id=self.yes_id,
                              no_id=self.no_id)[0]

    def check_block_positions(self, context_len: int, draft_len: int) -> None:
        """A verification block's last position (the longest prefix's suffix copy) must be a position of the target."""
        limit = self.target.config.max_position_embeddings
        end = context_len + draft_len + len(self.suffix_ids)
        if end > limit:
            raise InputError(f"context ({context_len}) + draft ({draft_len}) + suffix ({len(self.suffix_ids)}) tokens "
                             f"reach position {end}, past the target's max_position_embeddings ({limit})")

    def _ids(self, name: str, ids: Sequence[int]) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
            raise InputError(f"{name} must be a list of token ids, got {type(ids).__name__}")
        out = [check_int(f"{name}[{i}]", t, error=InputError) for i, t in enumerate(ids)]
        v = self.target.config.vocab_size
        bad = [t for t in out if not 0 <= t < v]
        if bad:
            raise InputError(f"{name}: token ids outside [0, {v}): {bad[:5]}")
        return out

    # --- generation ---------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], mode: Mode = "parse",
                 max_new_tokens: int | Sequence[int] = 256, temperature: float = 0.0, seed: int | Sequence[int] = 0,
                 top_k: int = 0, top_p: float = 1.0, eos_ids: Sequence[int] | None = None, *,
                 max_batch: int | None = None) -> GenerateResult:
        """Generate for a batch of prompts (texts, or token-id lists) with `mode`. `eos_ids`: the stop ids (default:
        the target's config, generation config and tokenizer EOS; [] = none). `max_batch`: at most this many rows
        at once: every mode keeps that many slots busy (a finished row's slot takes the next prompt).
        `max_new_tokens`: one budget, or one per prompt. `seed`: prompt i draws from `seed + i`, or give one seed per
        prompt; a prompt's draws do not depend on the others, `max_batch` or the batching (docs/design.md §3).
        Results come back in prompt order."""
        req = self.request(prompts, mode, max_new_tokens, temperature, seed, top_k, top_p, eos_ids)
        if max_batch is not None:
            max_batch = check_int("max_batch", max_batch, 1, error=InputError)
        # a run whose weights and caches cannot fit the device: one line, before anything is allocated
        rows = min(max_batch or len(req.ids), len(req.ids))
        rounds = self._rounds_options(mode, req, rows)  # those the schedule may take
        self.memory_guard.check(self.context, mode, req, rows, rounds if self.config.schedule == "auto" else (None,))
        fetches = FETCHES[0]
        with kernel_context(self.target):  # sharded Pallas kernels see the mesh (they run under shard_map)
            res = self._run_batches(mode, req, max_batch, rounds)
        res.stats["mode"] = mode
        res.stats["host_transfers"] = FETCHES[0] - fetches
        res.stats["compiled_programs"] = compiled_programs()
        return res

    def _run_batches(self, mode: str, req: Request, max_batch: int | None,
                     rounds: tuple[str | None, ...]) -> GenerateResult:
        """The request in batches of `max_batch` rows, each run with `mode` or, under `schedule="auto"`, with plain
        decoding where that is predicted (or was measured) faster at this batch size (docs/design.md §7). A mode that
        serves (continuous batching) takes the rest of the prompts at once, once the schedule has chosen it, and a
        choice the schedule explores a few fills of its slots (`EXPLORE_FILLS`)."""
        n = len(req.ids)
        size = n if max_batch is None else min(max_batch, n)
        parts, choices, start = [], [], 0
        # explored batches that measured: at most one per choice (plain decoding included) and call; explored
        # batches in all at most twice that (one that set programs up measured nothing, and may be explored again)
        explorations = attempts = 0
        setup_known = self._setup
        self.schedule_state = self.schedule_state.new_call()  # a contested choice is measured again once per call
        while start < n:
            # each prompt keeps its own seed, whatever batch it runs in
            batch = req.rows(start, min(start + size, n))
            choice = None
            if self.config.schedule == "auto" and mode != "target":
                outlook = Outlook(charge=self._charge(mode, rounds, len(batch.ids), batch.max_new, start),
                                  windows_after=self._windows_after(n, start, size))
                choice = self._choose(mode, batch, rounds, explore=start + size < n and explorations < len(rounds) + 1
                                      and attempts < 2 * (len(rounds) + 1), outlook=outlook)
                record = choice.as_dict()
                if record["rounds"] is None and MODE_TABLE[choice.run].honours_rounds:  # the rounds given
                    record["rounds"] = self.context.config.rounds
                choices.append(record)
                attempts += choice.explored
            run = mode if choice is None else choice.run
            ctx = self.context if choice is None else self._context(choice.rounds)
            ctx, price = self._priced(ctx, run, batch)
            setup_before = setup_split() if choice is not None else None
            spec, res = MODE_TABLE[run], None
            explored = choice is not None and choice.explored
            # the rest through `size` slots, a finished row's slot taking the next prompt; an explored choice through
            # the same programs over `EXPLORE_FILLS` x `size` prompts, leaving a batch for the pick (its slots
            # refilled, it is measured as the served rest would run it: a fixed batch waits for its slowest row);
            # `served`: it ran so
            explore = self._explore_prompts(n, start, size)
            rest = req.ids[start:start + explore] if explored else req.ids[start:]
            if spec.serve is not None and len(rest) > size:
                res = spec.serve(ctx, req.rows(start, start + len(rest)), size)
            served = res is not None
            if res is None:
                res = spec.runner(ctx, batch)
            if price is not None:
                res.stats["prefix_price"] = price
            if choice is not None:  # what the decision ran: its prompts, and its slots (None: a fixed batch)
                choices[-1].update(rows=len(res.tokens), slots=res.stats.get("slots"))
            if choice is not None and setup_events() == setup_before.events:  # jax set up nothing: measured
                explorations += explored
                longest = None if served else max(1, max(len(t) for t in res.tokens))  # a fixed batch's rows idle
                self.schedule_state = self.schedule_state.record(choice.name, min(size, len(res.tokens)), res.stats,
                                                                 longest=longest)
                ledger(self._setup_costs()).ready.add((self._setup_name(choice.run, choice.rounds),
                                                       bucket(len(batch.ids), 1)))
            elif choice is not None:  # it set up programs: what jax reported that took (and would, loaded)
                costs, now = self._setup_costs(), setup_split()
                paid = now - setup_before
                warm = paid.warm(now) if costs.cache_on else None
                self._setup = ledger(costs).pay(costs, self._setup_name(choice.run, choice.rounds),
                                                bucket(len(batch.ids), 1), paid.seconds, warm=warm,
                                                compiled=not (costs.cache_on and paid.loaded_all))
            parts.append(res)
            start += len(res.tokens)
            self._count_row_tokens(res.tokens)
        res = parts[0] if len(parts) == 1 else merge_results(parts)
        if choices:
            res.stats["schedule"] = choices
        self._prompts_run += n
        if self._job_left is not None:
            self._job_left = max(self._job_left - n, 0)
        if self._setup is not None and self._setup is not setup_known:
            self._setup.save()
        return res

    def _count_row_tokens(self, tokens: Sequence[Sequence[int]]) -> None:
        """Count a finished batch's answers into the tokens a row writes on average (each batch weighs half the
        figure; `_expected_row_tokens`)."""
        written = sum(len(t) for t in tokens) / max(len(tokens), 1)
        self._row_tokens = written if self._row_tokens is None else 0.5 * written + 0.5 * self._row_tokens

    def _expected_row_tokens(self, max_new: int) -> int:
        """The tokens a row of a `max_new` budget is expected to write: what rows have written on average, capped at
        the budget (answers end long before it: the embedded task's about 21 tokens of 256); the budget before any
        batch has finished."""
        return max_new if self._row_tokens is None else min(max_new, max(1, round(self._row_tokens)))

    @staticmethod
    def _explore_prompts(n: int, start: int, size: int) -> int:
        """The prompts an explored choice runs from `start`: `EXPLORE_FILLS` x its `size` slots (at least
        `EXPLORE_MIN_PROMPTS`), leaving at least a batch of the call's `n` for the pick (served where more than `size`,
        else one fixed batch of `size`)."""
        return min(max(EXPLORE_FILLS * size, EXPLORE_MIN_PROMPTS), n - start - size)

    def _windows_after(self, n: int, start: int, size: int) -> float:
        """The prompts expected after an explored window starting at `start`, in windows: what measuring a close call
        again must pay back (`schedule.auto.worth_measuring`). Expected: a one-off job's own; outside one, this call's
        or as many as the engine has run so far where more (work done so far predicts work to come: an engine called
        many times measures a close call again in time). The window: `_explore_prompts` served, or one fixed batch
        of `size` where fewer prompts are left (`_run_batches`)."""
        served = self._explore_prompts(n, start, size)
        window = served if served > size else size
        ahead = self._job_left - start if self._job_left is not None else max(n - start, self._prompts_run)
        left = max(ahead, n - start) - window
        return max(left, 0) / window

    def _charge(self, mode: str, rounds: tuple[str | None, ...], size: int, max_new: int,
                start: int) -> SetupCharge | None:
        """Inside a `job`: what setting each choice up at this batch bucket is still expected to cost this process
        (`SetupLedger.left`), over the decode steps the job has left (its prompts x the tokens a row writes on
        average, else the budget, / the rows)."""
        if self._job_left is None:
            return None
        b = bucket(size, 1)
        names = {PLAIN_CHOICE: PLAIN_CHOICE, **{choice_name(mode, r): self._setup_name(mode, r) for r in rounds}}
        setup = self._setup_costs()
        led = ledger(setup)
        left = {m: led.left(setup, kept, b, speculative=m != PLAIN_CHOICE) for m, kept in names.items()}
        rows = max(self._job_left - start, size)
        steps = rows * self._expected_row_tokens(max_new) / size
        return SetupCharge({m: v for m, v in left.items() if v is not None}, steps)

    def _setup_name(self, run: str, rounds: str | None) -> str:
        """The name a choice's setup figure is kept under: its mode and the rounds its programs run, explicit rounds
        included, so that one command's figure is found by another (bench's `parse`, single round by setting, sets
        up what eval's `parse-single` does)."""
        if rounds is None and MODE_TABLE[run].honours_rounds:
            rounds = self.context.config.rounds
        return choice_name(run, rounds)

    def _setup_costs(self) -> SetupCosts:
        """The setup figures of this engine's models, read from disk the first time they are needed."""
        if self._setup is None:
            self._setup = load_setup_costs(self.target, self.draft, self.eagle3)
        return self._setup

    def _cost_model(self) -> PassCosts:
        """The pass costs of this engine's models, loaded once: a cached profile, else the roofline."""
        if self._costs is None:
            self._costs = pass_costs(self.target, self.draft, head=self.eagle3)
        return self._costs

    @staticmethod
    def _cache_len(req: Request) -> int:
        """The cache buffer a batch's passes read: its longest prompt and its budget, bucketed."""
        return length_bucket(max(len(p) for p in req.ids) + req.max_new)

    def _choose(self, mode: str, req: Request, rounds: tuple[str | None, ...], *, explore: bool,
                outlook: Outlook) -> ScheduleChoice:
        """Plain decoding or `mode` (with each of `rounds`) for this batch, from the cost model and what earlier
        batches measured."""
        cfg = self.context.config
        knobs = Knobs(draft_tokens=cfg.max_draft_tokens, prefixes=cfg.max_prefixes, rounds=cfg.rounds,
                      gamma=cfg.speculation.gamma, eagle3_gamma=cfg.eagle3.gamma)  # settings are kept as given
        workload = Workload(batch=len(req.ids), cache_len=self._cache_len(req), suffix_tokens=len(self.suffix_ids),
                            remaining_tokens=self._expected_row_tokens(req.max_new))
        return choose(self.schedule_state, self._cost_model(), mode=mode, knobs=knobs, workload=workload, rounds=rounds,
                      explore=explore, outlook=outlook)

    def _priced(self, ctx: ModeContext, run: str, batch: Request) -> tuple[ModeContext, float | None]:
        """`ctx` with the price of a verified prefix for `batch` run as mode `run` (prefix_choice "auto",
        `schedule.prefix_price`, at the rows its programs run: a traced input, so no program compiles again), and
        that price; `ctx` itself and None for the other choices, and for plain decoding."""
        if ctx.round_spec.prefix_choice != "auto" or run == "target":
            return ctx, None
        price = prefix_price(self._cost_model(), batch=bucket(len(batch.ids), 1),
                             draft_tokens=min(ctx.config.max_draft_tokens, batch.max_new),
                             suffix_tokens=len(self.suffix_ids), cache_len=self._cache_len(batch),
                             separate_passes=MODE_TABLE[run].separate_prefix_passes)
        return dataclasses.replace(ctx, judge=ctx.judge.replace(prefix_price=jnp.float32(price))), price

    def _rounds_options(self, mode: str, req: Request, slots: int) -> tuple[str | None, ...]:
        """The rounds `schedule="auto"` may run `mode` with: multi and single where the user left `rounds="auto"`
        and the mode honours it (each where the request's positions fit), else the config's (None). In one slot a
        mode whose single round ends in plain decoding runs multi-round where it fits: its later rounds replace
        those plain steps and hold up no other row, and its gain sits on the few prompts the draft gets wrong, which
        a window of prompts may not hold (docs/design.md §7)."""
        spec = MODE_TABLE[mode]
        if self.config.rounds != "auto" or not spec.honours_rounds:
            return (None,)
        fits = self._fitting_rounds(req.ids, req.budget_list(), mode)
        if slots == 1 and spec.single_round_ends_plainly and "multi" in fits:
            return ("multi",)
        return fits or (None,)

    def _fitting_rounds(self, ids: list[list[int]], max_new: list[int], mode: str) -> tuple[str, ...]:
        """The rounds whose programs fit every prompt's positions, where `schedule="auto"` chooses them (the user
        left `rounds="auto"` and the mode honours it); () otherwise."""
        if self.config.schedule != "auto" or self.config.rounds != "auto" or not MODE_TABLE[mode].honours_rounds:
            return ()
        fits = []
        for rounds in ("multi", "single"):
            try:
                self._check_positions(ids, max_new, mode, self._context(rounds))
                fits.append(rounds)
            except InputError:
                pass
        return tuple(fits)

    def _context(self, rounds: str | None) -> ModeContext:
        """The engine's context, with `rounds` when given (what a batch the schedule chose runs)."""
        return self.context if rounds is None else self._contexts[rounds]

    def request(self, prompts, mode: str, max_new_tokens, temperature, seed, top_k, top_p,
                eos_ids) -> Request:
        """A validated request: every check that can fail happens here, before any program runs or allocates."""
        check_choice("mode", mode, MODES, error=InputError)
        if not per_prompt(max_new_tokens):
            check_int("max_new_tokens", max_new_tokens, 1, error=InputError)  # before the prompts are encoded
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        spec = MODE_TABLE[mode]
        if spec.needs_draft and self.draft is None:
            raise ConfigError(f"mode {mode!r} needs a draft model: ParseEngine(target, draft, ...)")
        if spec.needs_head and self.eagle3 is None:
            raise ConfigError(f"mode {mode!r} needs an EAGLE-3 head for the target: pass --eagle3 DIR (CLI) or "
                              "ParseEngine(..., eagle3=pj.load_eagle3(DIR, target)); train one with "
                              "`parse-jax train-eagle3` (the embedded pair ships one)")
        if spec.needs_head:
            check_tree(self.config.eagle3.tree, sampling.temperature)
        eos_ids = check_eos_ids(eos_ids, self.target.config.vocab_size)
        ids = encode_prompts(self.target, prompts)
        sampling.check_prompts(len(ids))
        max_new, budgets = check_budgets(max_new_tokens, len(ids))
        each = list(budgets) if budgets is not None else [max_new] * len(ids)
        if not self._fitting_rounds(ids, each, mode):  # else the schedule runs the rounds that fit
            self._check_positions(ids, each, mode, self.context)
        if spec.judged:  # a valid request of a mode that judges
            self._warn_settings()
        return Request(ids=ids, max_new=max_new, sampling=sampling, eos=resolve_eos(self.target, eos_ids),
                       budgets=budgets)

    def _warn_settings(self) -> None:
        """Say once, where the judge first runs, that a chat model is judged with the embedded task's settings."""
        if self._settings_warning is not None:
            logger.warning(self._settings_warning)
            self._settings_warning = None

    def _check_positions(self, ids: list[list[int]], budgets: list[int], mode: str, ctx: ModeContext) -> None:
        """Every mode writes a prompt's `max_new_tokens` (`budgets`, one per prompt) past it plus what its passes
        write beyond the last token it may emit (its draft: what it drafts): all of it must fit the models'
        positions, checked before any cache is allocated."""
        spec = MODE_TABLE[mode]
        models = [("target", self.target, spec.target_positions)]
        if spec.draft_positions is not None:
            models.append(("draft", self.draft, spec.draft_positions))
        for name, model, positions in models:
            limit = model.config.max_position_embeddings
            for i, (p, budget) in enumerate(zip(ids, budgets)):
                extra = positions(ctx, budget)
                if len(p) + extra > limit:
                    raise InputError(f"prompt {i} has {len(p)} tokens; mode {mode} with max_new_tokens={budget} "
                                     f"needs {len(p) + extra} positions (cache slots) in the {name}, which holds "
                                     f"{limit} (max_position_embeddings)")

    # --- ahead of time --------------------------------------------------------------------------------------

    def lower(self, mode: str, batch_size: int = 1, max_new_tokens: int = 256, *, platform: str | None = None,
              chip: str | None = None, prompt_len: int = 64, mesh=None, attention_impl: str = "pallas"):
        """The programs a run of `mode` would compile, lowered for `platform` ("tpu" or "cuda"; default: the chip's,
        or tpu) and `chip` (v4, v5e, v5p, v6e, h100, h200; default: v5e / h100) from this machine, over an abstract
        (data, model) `mesh` of such chips when given ("data=2,model=4"), with the run's memory plan: a
        `parse_jax.lowering.run.LoweredRun`. Nothing is compiled or allocated; the models' params are read as shapes
        only. See docs/lowering.md."""
        from parse_jax.lowering.run import LowerTarget, lower_run

        return lower_run(self, mode, batch_size, max_new_tokens, prompt_len=prompt_len,
                         target=LowerTarget(platform, chip, mesh, attention_impl))
