"""Continuous batching of plain decoding: `max_batch` slots stay busy over any number of prompts.

A request holds one slot (a row of one KV cache) from its prefill to its last token; when it finishes, the next
prompt is prefilled into that row while the other slots keep their caches. Two programs, each compiled once for the
run's shapes (slot count, cache length, prompt bucket), so no prompt compiles anything of its own:
- `admit`: prefill up to k waiting prompts (k bucketed) in a small cache, draw each one's first token, and move
  their rows into the slots the host names (the other rows are untouched);
- `decode`: one-token steps over every slot in a `lax.while_loop` until enough slots are free for the next
  admission (or every slot is done).
Between the two the host reads one small result (which slots finished, their tokens): the only host sync, once per
admission. A row's tokens depend only on its own cache row, so greedy outputs equal those of the prompt alone.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder, causal_metadata
from parse_jax.runtime.decode import is_eos, prefill
from parse_jax.runtime.programs import bucket, committed, fetch, forward_fn, length_bucket, register_program
from parse_jax.runtime.requests import PAD_ID, GenerateResult, GenerationStats, Request, SamplingParams
from parse_jax.runtime.sampling import Sampler, SamplingArgs, unread_keys


@struct.dataclass
class SlotState:
    """Every slot's request in flight. An empty slot is `done`."""

    cache: KVCache
    tokens: jax.Array    # [B, N] the slot's generated ids (PAD_ID past num_new)
    num_new: jax.Array   # [B]
    done: jax.Array      # [B]
    last: jax.Array      # [B] the next step's input
    max_new: jax.Array   # [B] the slot's budget
    keys: jax.Array      # [B, 2] the slot's request's key: its token j draws with `fold_in(key, j - first)`
    first: jax.Array     # [B] the row's tokens before its decoding here began (a verification's accepted prefix)
    steps: jax.Array     # scalar: decode passes run so far


@struct.dataclass
class Admission:
    """Up to k prompts for the free slots named in `slots` (k bucketed; unused entries name slot B: dropped)."""

    slots: jax.Array      # [k]
    prompt: jax.Array     # [k, P]
    lens: jax.Array       # [k]
    max_new: jax.Array    # [k]
    keys: jax.Array       # [k, 2] each prompt's key (its draws', whatever slot or admission it gets)


@functools.cache
def _programs(cfg: ModelConfig, attention_impl: str, num_new: int, cache_len: int, sampler: Sampler):
    """(admit, decode) jitted for one run's shapes; the slot state is donated to both."""
    module = Decoder(cfg, attention_impl)

    def admit(params, state: SlotState, adm: Admission, eos_ids, args: SamplingArgs) -> SlotState:
        forward = forward_fn(module, params)
        cache, first_logits = prefill(forward, cfg, adm.prompt, adm.lens, cache_len)
        tok = sampler.sample(first_logits, args.with_keys(adm.keys).fold(0))  # token 0
        first = jnp.full((tok.shape[0], num_new), PAD_ID, jnp.int32).at[:, 0].set(tok)
        done = is_eos(tok, eos_ids) | (adm.max_new <= 1)
        rows = SlotState(cache=cache, tokens=first, num_new=jnp.ones_like(tok), done=done, last=tok,
                         max_new=adm.max_new, keys=adm.keys, first=jnp.zeros_like(tok), steps=state.steps)
        return put_rows(state, rows, adm.slots)

    def decode(params, state: SlotState, free_target, eos_ids, args: SamplingArgs) -> SlotState:
        return decode_slots(forward_fn(module, params), state, free_target, eos_ids, args, sampler)

    return (register_program(jax.jit(admit, donate_argnums=(1,))),
            register_program(jax.jit(decode, donate_argnums=(1,))))


def decode_slots(forward, state: SlotState, free_target, eos_ids, args: SamplingArgs, sampler: Sampler) -> SlotState:
    """One-token steps over every slot until `free_target` slots are done (or all are): the advance of every served
    run whose rows continue with plain decoding (the target alone; PARSE after its verification). A slot's token j
    draws with its own `fold_in(keys, j - first)`, as a fixed batch's `decode_loop` draws its step j - first (`args`
    gives the temperature and top_p)."""
    num_new = state.tokens.shape[1]
    b = state.done.shape[0]
    rows = jnp.arange(b)

    def cond(s: SlotState) -> jax.Array:
        return ~jnp.all(s.done) & (jnp.sum(s.done) < free_target)

    def body(s: SlotState) -> SlotState:
        limit, group = causal_metadata(b, 1)
        logits, cache = forward(s.last[:, None], s.cache.lengths[:, None], s.cache, limit, group)
        cache = cache.commit((~s.done).astype(jnp.int32))
        tok = sampler.sample(logits[:, 0], args.with_keys(s.keys).fold(s.num_new - s.first))
        tok = jnp.where(s.done, PAD_ID, tok)
        at = jnp.minimum(s.num_new, num_new - 1)
        tokens = s.tokens.at[rows, at].set(jnp.where(s.done, s.tokens[rows, at], tok))
        num = s.num_new + (~s.done).astype(jnp.int32)
        done = s.done | is_eos(tok, eos_ids) | (num >= s.max_new)
        return s.replace(cache=cache, tokens=tokens, num_new=num, done=done, last=jnp.where(s.done, s.last, tok),
                         steps=s.steps + 1)

    return jax.lax.while_loop(cond, body, state)


def put_rows(big, small, slots: jax.Array):
    """`small` (a state of k rows) written into rows `slots` of `big`, a state of the same type over every slot (an
    entry naming slot B, past the last, is dropped); scalar leaves (run-wide counters) keep `big`'s."""
    return jax.tree.map(lambda x, y: x if jnp.ndim(x) == 0 else x.at[slots].set(y, mode="drop"), big, small)


def empty_state(cfg: ModelConfig, slots: int, num_new: int, cache_len: int) -> SlotState:
    return SlotState(cache=KVCache.init(cfg, slots, cache_len), tokens=jnp.full((slots, num_new), PAD_ID, jnp.int32),
                     num_new=jnp.zeros((slots,), jnp.int32), done=jnp.ones((slots,), bool),
                     last=jnp.zeros((slots,), jnp.int32), max_new=jnp.zeros((slots,), jnp.int32),
                     keys=jnp.asarray(unread_keys(slots)),
                     first=jnp.zeros((slots,), jnp.int32), steps=jnp.int32(0))


class SlotBook:
    """The host's record of which request holds each slot, between the device programs of a served run (plain
    decoding here, multi-round PARSE in modes/parse_multi.py): the waiting requests, each slot's holder, and when
    to stop the device loop."""

    def __init__(self, requests: int, slots: int, capacity: int) -> None:
        self.waiting = collections.deque(range(requests))
        self.holder = [-1] * slots  # request index in each slot (-1: free)
        self.slots, self.capacity = slots, capacity

    def admit(self) -> tuple[list[int], np.ndarray] | None:
        """(the requests to admit now, the slot of each entry of their k-bucket: unused entries name slot B, which
        the programs drop), or None when no slot is free or nothing waits. The slots are taken."""
        free = [s for s in range(self.capacity) if self.holder[s] < 0]
        take = min(len(free), len(self.waiting))
        if not take:
            return None
        batch = [self.waiting.popleft() for _ in range(take)]
        where = np.array([free[i] if i < take else self.slots for i in range(bucket(take, 1))], np.int32)
        for s, r in zip(free, batch):
            self.holder[s] = r
        return batch, where

    def free_target(self) -> np.int32:
        """How many done slots end the device loop: with requests waiting, the first slot that frees up; with none,
        every slot at its end (empty slots are done: they count as free)."""
        busy = sum(h >= 0 for h in self.holder)
        return np.int32(self.slots - busy + 1 if self.waiting else self.slots)

    def finish(self, done: np.ndarray) -> list[tuple[int, int]]:
        """(slot, request) of every held slot now done; those slots are freed."""
        out = [(s, r) for s, r in enumerate(self.holder) if r >= 0 and done[s]]
        for s, _ in out:
            self.holder[s] = -1
        return out

    @property
    def empty(self) -> bool:
        return not self.waiting and all(h < 0 for h in self.holder)


_WARMED: set[tuple[Hashable, int, int]] = set()  # (run key, slots, k-bucket) admitted empty in this process
_WARM_UP = [False]  # inside `admission_warm_up`


@contextlib.contextmanager
def admission_warm_up():
    """Inside, a served run sets up every admission size its slots can meet in its first call (`warm_admissions`):
    what a benchmark wants before it times (`harness/runs.measure`). Off elsewhere: a one-off job would pay setup for
    sizes it may never meet (tens of seconds per size for PARSE's admission on this CPU)."""
    previous, _WARM_UP[0] = _WARM_UP[0], True
    try:
        yield
    finally:
        _WARM_UP[0] = previous


def warm_admissions(admit: Callable[[Any, list[int], np.ndarray, int], Any], state, *, slots: int, key: Hashable):
    """`state` after an empty admission of every k-bucket a run over `slots` slots can meet (each entry names slot
    `slots`, past the last, which the programs drop: no row, no counter moves), once per `key` (the run's programs and
    prompt bucket) and bucket in the process. Without it a choice the schedule first serves mid-run compiles one
    admission size per later run, inside their timings (docs/design.md §7); with it, all of them in its first."""
    k = 1
    while _WARM_UP[0] and k <= slots:
        if (key, slots, k) not in _WARMED:
            state = admit(state, [], np.full((k,), slots, np.int32), 0)
            _WARMED.add((key, slots, k))
        k *= 2
    return state


def serve_loop(book: SlotBook, state, *, admit: Callable[[Any, list[int], np.ndarray, int], Any],
               advance: Callable[[Any, np.int32], Any], rows: Callable[[Any], dict], warm: Hashable = None):
    """A served run to its end: admit waiting requests into free slots, advance every slot until enough are free,
    read the finished slots' rows (the one host read per admission). `admit(state, requests, where, i)` -> state
    (the i-th admission, `where` from `SlotBook.admit`; `requests` empty: a warm-up, counted nowhere);
    `advance(state, free_target)` -> state; `rows(state)` -> the arrays to read, per slot (leading axis: slots;
    "done" among them) or run-wide (scalars); `warm`: the key of `warm_admissions` (None: none; it runs inside
    `admission_warm_up` only). Returns (each request's row as a dict, in request order; the admissions made; the
    run-wide entries of the last read)."""
    out: list[dict | None] = [None] * len(book.waiting)
    admissions, read = 0, {}
    if warm is not None:
        state = warm_admissions(admit, state, slots=book.slots, key=warm)
    while True:
        admitted = book.admit()
        if admitted is not None:
            state = admit(state, *admitted, admissions)
            admissions += 1
        state = advance(state, book.free_target())
        read = fetch(rows(state))
        for s, r in book.finish(read["done"]):
            out[r] = {k: v[s] for k, v in read.items() if np.ndim(v)}
        if book.empty:
            break
    return out, admissions, {k: v for k, v in read.items() if not np.ndim(v)}


def request_budgets(req: Request, budgets: list[int] | None) -> list[int]:
    """Each prompt's budget in a served run: its own where given (at most the request's), else the request's."""
    return req.budget_list() if budgets is None else [min(int(x), req.max_new) for x in budgets]


def rows_by_request(counters: list[tuple[list[int], dict]], counted: list[dict], n: int,
                    keys) -> dict[str, list]:
    """Per-request rows of what each admission returned (`counters`: its requests and device arrays; `counted`:
    those arrays on the host, in the same order): {key: [row of request 0, ...]}."""
    per: dict[str, list] = {k: [None] * n for k in keys}
    for (batch, _), got in zip(counters, counted):
        for j, r in enumerate(batch):
            for key in per:
                per[key][r] = got[key][j]
    return per


def admission(ids: list[list[int]], batch: list[int], where: np.ndarray, *, prompt_len: int, max_new: list[int],
              keys: np.ndarray) -> Admission:
    """The `Admission` of requests `batch` (their prompts padded to `prompt_len`; `keys`: every request's, [n, 2])
    into slots `where`: unused entries of the k-bucket hold a one-token empty prompt with no budget."""
    k, take = len(where), len(batch)
    return Admission(
        slots=where,
        prompt=np.array([ids[r] + [PAD_ID] * (prompt_len - len(ids[r])) for r in batch]
                        + [[PAD_ID] * prompt_len] * (k - take), np.int32),
        lens=np.array([len(ids[r]) for r in batch] + [1] * (k - take), np.int32),
        max_new=np.array([max_new[r] for r in batch] + [0] * (k - take), np.int32),
        keys=admission_keys(keys, batch, k))


def admission_keys(keys: np.ndarray, batch: list[int], k: int) -> np.ndarray:
    """[k, 2] the keys of requests `batch` (of every request's `keys`), then zeros for the k-bucket's unused entries."""
    out = np.zeros((k, *keys.shape[1:]), keys.dtype)
    out[:len(batch)] = keys[batch]
    return out


def serve(model, ids: list[list[int]], *, max_new: list[int], sampling: SamplingParams, eos: np.ndarray,
          max_batch: int) -> tuple[list[list[int]], dict]:
    """Every prompt's generated ids, in prompt order, with at most `max_batch` in flight (slots refilled as rows
    finish), and counts {"target_passes", "admissions", "seconds"}. `ids` must fit the model's positions."""
    cfg: ModelConfig = model.config
    capacity = min(max_batch, len(ids))  # slots handed out; the program's batch is its bucket (the rest stay empty)
    slots = bucket(capacity, 1)
    p = bucket(max(len(x) for x in ids))
    n = bucket(max(max_new), 16)
    cache_len = min(length_bucket(p + n), cfg.max_position_embeddings)
    admit, decode = _programs(cfg, model.attention_impl, n, cache_len, sampling.sampler)
    args, keys = sampling.args(1), sampling.keys(len(ids))
    t0 = time.perf_counter()
    rows, admissions, run = serve_loop(
        SlotBook(len(ids), slots, capacity), committed(empty_state(cfg, slots, n, cache_len), model.params),
        admit=lambda st, batch, where, i: admit(model.params, st, admission(ids, batch, where, prompt_len=p,
                                                                             max_new=max_new, keys=keys), eos, args),
        advance=lambda st, free: decode(model.params, st, free, eos, args),
        rows=lambda st: {"done": st.done, "num_new": st.num_new, "tokens": st.tokens, "steps": st.steps},
        warm=(admit, p))
    seconds = time.perf_counter() - t0
    stats = {"target_passes": int(run["steps"]) + admissions, "admissions": admissions, "seconds": seconds,
             "slots": capacity}
    return [r["tokens"][: r["num_new"]].tolist() for r in rows], stats


def serve_request(model, req: Request, *, max_batch: int) -> GenerateResult:
    """A validated request (`ParseEngine.request`) by continuous batching through `max_batch` slots."""
    tokens, counts = serve(model, req.ids, max_new=req.budget_list(), sampling=req.sampling, eos=req.eos,
                           max_batch=max_batch)
    stats = GenerationStats(new_tokens=sum(len(t) for t in tokens), seconds=counts["seconds"],
                            target_passes=counts["target_passes"])
    texts = [model.tokenizer.decode(t) if model.tokenizer is not None else "" for t in tokens]
    new = sum(len(t) for t in tokens)  # a row's passes: its prefill (the first token), then a step per token
    return GenerateResult(texts=texts, tokens=tokens, stats={**stats.as_dict(), "slots": counts["slots"],
                                                             "admissions": counts["admissions"],
                                                             "request_passes": new, "request_checks": new})
