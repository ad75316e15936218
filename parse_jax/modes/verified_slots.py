"""Continuous batching of the modes that verify once and then let the target write the rest token by token
(single-round `parse`, `sequential`): a request's verification runs when it is admitted into a slot, and its
continuation shares the slots' plain decoding (`runtime/slots.decode_slots`) with every other request in flight.

Admission: the mode's verification on up to k waiting prompts (k bucketed), then each row's accepted prefix, the
target's cache holding it and the first continuation token written into the free slots (one program; single-round
parse's staged, `Staged`: its draft first, then, the host having read the block length that draft needs, the rest
over that one length). Advance: one-token steps over every slot until enough are free. Place: parked rows (below)
into free slots. Each compiles once per run's shapes (and block length); the host reads one small result per
admission or placement, and a staged admission's block length. A row reads only its own cache
row, so greedy outputs equal each prompt alone.

Verifying ahead: most rows of a good draft end at their verification (the answer accepted whole) and never need a
slot, and a verification pass costs less per row the more rows it holds (the embedded pair at batch 4: 9.0 ms for
one row, 24.5 for four). So an admission verifies up to a slot bucket of waiting prompts however few slots are
free: the rows that end there are done, the rows that continue take the free slots in order, and the rest wait in a
park of verified rows (their cache, accepted prefix and first continuation token) for the next free slot, which
a parked row takes without a pass (`place`). An admission runs only where a free slot is left once the parked
rows have taken theirs and verifies at most the slot bucket B, so at most B - 1 rows wait: the park has B - 1 rows
(none at one slot), the target's KV cache of such a run (2 - 1/B) times the slots'.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from parse_jax.models.decoder import Decoder
from parse_jax.modes.context import ModeContext, PairSpec, parse_result
from parse_jax.runtime.decode import is_eos
from parse_jax.runtime.programs import bucket, committed, fetch, forward_fn, register_program
from parse_jax.runtime.requests import PAD_ID, GenerateResult, Prompts, Request
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.runtime.slots import (
    Admission,
    SlotBook,
    SlotState,
    admission,
    decode_slots,
    empty_state,
    put_rows,
    request_budgets,
    rows_by_request,
    warm_admissions,
)
from parse_jax.verify.round import pick_length

# the per-row counters of a verification that a PARSE-family result reads (parse_result)
ROW_STATS = ("accepted", "prefixes", "draft_len", "block_tokens", "rejected_at", "score_hist")

Verify = Callable[..., dict]  # (target_params, draft_params, prompts, eos_ids, judge, args[, drafted]) -> dict


@dataclasses.dataclass(frozen=True)
class Staged:
    """A verification in two programs, so that a served run sets up only the block lengths its admissions meet:
    `draft` (draft_params, prompts, eos_ids, judge, args) -> (drafted, the block length its pass needs), read by the
    host; `verifier(length)`, of one of `lengths`, a `Verify` that takes `drafted` last. One program over every
    length (a `lax.switch`) would set every length's pass up (docs/design.md §5)."""

    draft: Callable
    verifier: Callable[[int], Verify]
    lengths: tuple[int, ...]


def boundary_rows(v: dict, max_new: jax.Array, eos_ids: jax.Array, *, width: int, sampler: Sampler,
                  args: SamplingArgs, steps: jax.Array) -> SlotState:
    """Slot rows after a verification: the accepted draft prefix, then (where the row has tokens left) the first
    continuation token drawn from the target's logits after it; a row whose answer ended, or whose budget is spent,
    is done. `args`: the rows' continuation keys (its token j past the accepted prefix draws with `fold_in(key, j)`,
    here and in the slots after, as a fixed batch's continuation draws it)."""
    draft, accepted, live = v["draft"], v["accepted"], v["live"]
    k, d = draft.shape
    tok = sampler.sample(v["first_logits"], args.fold(0))
    keep = jnp.arange(d)[None] < accepted[:, None]
    tokens = jnp.concatenate([jnp.where(keep, draft, PAD_ID), jnp.full((k, width - d), PAD_ID, jnp.int32)], axis=1)
    tokens = tokens.at[jnp.arange(k), accepted].set(jnp.where(live, tok, PAD_ID))
    num = accepted + live.astype(jnp.int32)
    done = ~live | is_eos(tok, eos_ids) | (num >= max_new)
    return SlotState(cache=v["cache"], tokens=tokens, num_new=num, done=done, last=tok, max_new=max_new,
                     keys=args.key, first=accepted, steps=steps)


@struct.dataclass
class AheadSlots:
    """A served run that verifies ahead: its slots, the verified rows waiting for one (rows [0, parked) of `park`,
    in the order they were verified) and how many of the slot bucket's rows it hands out (`capacity`)."""

    slots: SlotState
    park: SlotState
    parked: jax.Array    # scalar
    capacity: jax.Array  # scalar


def place(ahead: AheadSlots, rows: SlotState | None = None) -> tuple[AheadSlots, jax.Array]:
    """The parked rows (`rows` None), or a verification's `rows` (into an empty park), in order: each row that still
    writes tokens put in the next free slot, the rest parked in that order; a row that ended is dropped (its tokens
    are in `rows`). Returns the state and each candidate's destination: its slot, B + its park row, or B + P (none).
    An admission never reads the park it writes (the host places the parked rows first, `run_ahead`): a program
    that moved rows out of the park and into it copied the park, B - 1 cache rows more at its peak. The host keeps
    no more candidates than the free slots and the park can take."""
    slots, park = ahead.slots, ahead.park
    b, p = slots.done.shape[0], park.done.shape[0]
    if rows is None:
        moving, need = park, (jnp.arange(p) < ahead.parked) & ~park.done
    else:
        moving, need = rows, ~rows.done
    free = (jnp.arange(b) < ahead.capacity) & slots.done
    free_ids = jnp.nonzero(free, size=b, fill_value=b)[0]
    n_free = jnp.sum(free)
    rank = jnp.cumsum(need) - 1
    to_slot = jnp.where(need & (rank < n_free), free_ids[jnp.clip(rank, 0, b - 1)], b)
    to_park = jnp.where(need & (rank >= n_free), rank - n_free, p)
    slots = put_rows(slots, moving, to_slot)
    park = put_rows(park, moving, to_park)  # the rows parked now, at the front (placing: the park compacted)
    parked = jnp.maximum(jnp.sum(need) - n_free, 0).astype(jnp.int32)
    if rows is not None:  # rows still parked were overwritten: the count then disagrees with the host's, which raises
        parked = parked + ahead.parked
    where = jnp.where(to_slot < b, to_slot, b + jnp.minimum(to_park, p))
    return AheadSlots(slots=slots, park=park, parked=parked, capacity=ahead.capacity), where


@functools.cache
def admit_program(pair: PairSpec, verify: Verify, width: int, sampler: Sampler):
    """An admission of one run's shapes, the state donated: it verifies the admission (`verify`: a staged run has one
    per block length) and places its rows (`place`), returning the state, each candidate's destination, the admitted
    rows' tokens (those that ended there are read from them) and their verification counters (ROW_STATS present in
    the verification, and its `verify_passes`)."""

    def admit(target_params, draft_params, ahead: AheadSlots, adm: Admission, eos_ids, judge, args: SamplingArgs,
              drafted=None):
        prompts = Prompts(tokens=adm.prompt, lens=adm.lens, max_new=adm.max_new)
        own = args.with_keys(adm.keys)
        v = verify(target_params, draft_params, prompts, eos_ids, judge, own,
                   *(() if drafted is None else (drafted,)))
        rows = boundary_rows(v, adm.max_new, eos_ids, width=width, sampler=sampler, args=own.fold(1),
                             steps=ahead.slots.steps)
        continued = v["live"] & ~v["stop"]  # a stop row emits its EOS here, with no pass
        counters = {"continued": continued, **{k: v[k] for k in (*ROW_STATS, "verify_passes") if k in v}}
        ahead, where = place(ahead, rows)
        return ahead, where, {"tokens": rows.tokens, "num_new": rows.num_new}, counters

    return register_program(jax.jit(admit, donate_argnums=(2,)))


@functools.cache
def place_program():
    """The parked rows into free slots (`place`), the state donated: one program for every run that verifies
    ahead (jit sets it up per state shape)."""
    return register_program(jax.jit(lambda ahead: place(ahead), donate_argnums=(0,)))


@functools.cache
def advance_program(pair: PairSpec, sampler: Sampler):
    """One-token steps over every slot until enough are free, the state donated."""
    target = Decoder(pair.target, pair.target_impl)

    def advance(target_params, ahead: AheadSlots, free_target, eos_ids, args: SamplingArgs):
        slots = decode_slots(forward_fn(target, target_params), ahead.slots, free_target, eos_ids, args, sampler)
        return ahead.replace(slots=slots)

    return register_program(jax.jit(advance, donate_argnums=(1,)))


@functools.cache
def draft_program(draft: Callable):
    """The first of a staged admission's programs (`Staged.draft`): the draft of the admitted prompts, drawn as the
    one-program admission draws it (`admit_program`), and the block length their verification needs."""

    def draft_admission(draft_params, adm: Admission, eos_ids, judge, args: SamplingArgs):
        prompts = Prompts(tokens=adm.prompt, lens=adm.lens, max_new=adm.max_new)
        return draft(draft_params, prompts, eos_ids, judge, args.with_keys(adm.keys))

    return register_program(jax.jit(draft_admission))


def admit_staged(staged: Staged, ahead, draft_args: tuple, *, warm_up: bool, admit_at: Callable) -> tuple:
    """A staged admission: `draft_program` over `draft_args` (draft_params, admission, eos_ids, judge, args), the
    host's read of the block length its pass needs, then `admit_at(length, ahead, drafted)` -> (ahead, ...) over
    that one length; an empty admission (`warm_up`) sets every length up, one after the other."""
    drafted, needed = draft_program(staged.draft)(*draft_args)
    lengths = staged.lengths if warm_up else (pick_length(staged.lengths, int(fetch(needed))),)
    for n in lengths:
        out = admit_at(n, ahead, drafted)
        ahead = out[0]
    return out


def park_rows(slots: int) -> int:
    """The park of a run over `slots` slots: an admission runs with a slot free after the parked rows took theirs
    and verifies at most `slots` rows, so at most `slots` - 1 wait."""
    return slots - 1


class AheadBook(SlotBook):
    """`SlotBook` (the waiting requests, each slot's holder) of a run that verifies ahead, with the parked requests
    (in park order) and each request's row once it ended. Its admissions are sized by `to_verify`, not `admit`."""

    def __init__(self, requests: int, slots: int, capacity: int) -> None:
        super().__init__(requests, slots, capacity)
        self.park = park_rows(slots)
        self.parked: list[int] = []
        self.out: list[dict | None] = [None] * requests
        self.ever_parked: set[int] = set()  # requests that waited in the park

    def free(self) -> int:
        return sum(h < 0 for h in self.holder[: self.capacity])

    def to_verify(self) -> int:
        """How many waiting prompts the next admission verifies: where free slots are left once the parked rows
        have taken theirs, up to the slot bucket, as many as those slots and the park's room can take (0: the
        parked rows fill the free slots)."""
        free = self.free()
        if free <= len(self.parked):
            return 0
        return min(len(self.waiting), self.slots, free + self.park - len(self.parked))

    def settle(self, candidates: list[int], where: np.ndarray, admitted: dict | None) -> None:
        """Where a placement of the parked rows (`admitted` None) or an admission put each candidate (`place`'s
        `where`); an admitted row that went nowhere ended at its verification: its row is read from `admitted`."""
        parked = [-1] * self.park
        for i, r in enumerate(candidates):
            if r < 0:
                continue
            w = int(where[i])
            if w < self.slots:
                self.holder[w] = r
            elif w - self.slots < self.park:
                parked[w - self.slots] = r
            elif admitted is not None:
                self.out[r] = {k: v[i] for k, v in admitted.items() if np.ndim(v)}
            else:  # a row that needs a slot went nowhere: the host's count of the park was off
                raise RuntimeError(f"served run: request {r} was neither placed, parked nor ended")
        self.parked = [r for r in parked if r >= 0]
        self.ever_parked.update(self.parked)

    def finish(self, read: dict) -> list[tuple[int, int]]:
        """`SlotBook.finish` of `read["done"]`, keeping each finished request's row of `read`."""
        finished = super().finish(read["done"])
        for s, r in finished:
            self.out[r] = {k: v[s] for k, v in read.items() if np.ndim(v)}
        return finished

    def free_target(self, admitted: bool = False) -> np.int32:
        """Done slots that end the device loop: with anything waiting or parked (or maybe parked by the admission
        just made, `admitted`), the first free slot (empty slots past the capacity count); else every slot."""
        pending = self.waiting or self.parked or admitted
        return np.int32(self.slots - self.capacity + 1 if pending else self.slots)

    @property
    def empty(self) -> bool:
        return super().empty and not self.parked


def run_ahead(book: AheadBook, state: AheadSlots, *, admit: Callable, place: Callable, advance: Callable,
              read: Callable[[object], dict], warm: Hashable) -> tuple[dict, int, list[tuple[list[int], dict]]]:
    """A served run that verifies ahead (module docstring), to its end: move parked rows into free slots (their
    own program, so that an admission never reads the park it writes), admit where `book.to_verify` says, then
    advance every slot until enough are free, and read the slots (the one host read per admission).
    `admit(state, requests, where, i)` -> (state, each candidate's destination, the admitted rows' outputs, their
    counters); `place(state)` -> (state, destinations); `advance(state, free_target)` -> state; `read(slots)` ->
    the arrays to read, per slot ("done" among them) or run-wide (scalars); `warm`: the key of
    `runtime/slots.warm_admissions` (its empty admissions, then one placement, set up every program). Each
    request's row lands in `book.out`. Returns (the run-wide entries of the last read, the admissions made, each
    admission's requests and counters, read once at the end)."""
    warmed = warm_admissions(lambda st, *a: admit(st, *a)[0], state, slots=book.slots, key=warm)
    if warmed is not state:  # empty admissions ran (nothing placed): set up the placement too
        warmed, _ = place(warmed)
    state, counters = warmed, []  # each admission's requests and its counters (on the device until the end)
    while True:
        take, moves = book.to_verify(), []  # moves: (candidates, their destinations, the admitted rows or None)
        if book.parked and book.free():  # parked rows first: an admission only runs where they all found a slot
            state, placed = place(state)
            moves.append((book.parked + [-1] * (book.park - len(book.parked)), placed, None))
        if take:
            batch = [book.waiting.popleft() for _ in range(take)]
            where = np.full((bucket(take, 1),), book.slots, np.int32)
            state, placed, rows, got = admit(state, batch, where, len(counters))
            counters.append((batch, got))
            moves.append((batch + [-1] * (len(where) - take), placed, rows))
        state = advance(state, book.free_target(admitted=bool(take)))
        got = fetch({"slots": read(state.slots), "moved": [m[1:] for m in moves], "parked": state.parked})
        for (candidates, _, _), (placed, rows) in zip(moves, got["moved"]):
            book.settle(candidates, placed, rows)
        if int(got["parked"]) != len(book.parked):  # a dropped row would be silently wrong output
            raise RuntimeError(f"served run: {int(got['parked'])} rows parked on the device, {len(book.parked)} "
                               "on the host")
        book.finish(got["slots"])
        if book.empty:
            counted = fetch([c for _, c in counters])
            return ({k: v for k, v in got["slots"].items() if not np.ndim(v)}, len(counters),
                    [(batch, c) for (batch, _), c in zip(counters, counted)])


def serve_verified(ctx: ModeContext, req: Request, max_batch: int, *, verify: Verify | Staged, draft_new: int,
                   num_new: int, cache_len: int, budgets: list[int] | None = None) -> GenerateResult:
    """A validated request through `max_batch` slots, verified at admission by `verify` (drafts of `draft_new`
    tokens; `Staged`: drafted first, the host then picks the one block length the pass needs), ahead of the free
    slots (module docstring), continued by plain decoding (`num_new` tokens past the draft at most, caches of
    `cache_len`). `budgets`: each prompt's own max_new_tokens, at most the request's."""
    ids, target = req.ids, ctx.target
    budgets = request_budgets(req, budgets)
    pair = PairSpec.of(ctx)
    width = draft_new + num_new
    sampler = req.sampling.sampler
    staged = verify if isinstance(verify, Staged) else None
    place_parked, advance = place_program(), advance_program(pair, sampler)
    used = min(max_batch, len(ids))
    slots = bucket(used, 1)
    p = bucket(max(len(x) for x in ids))
    args, keys, params = req.sampling.args(1), req.sampling.keys(len(ids)), (target.params, ctx.draft.params)
    book = AheadBook(len(ids), slots, used)
    state = AheadSlots(slots=empty_state(pair.target, slots, width, cache_len),
                       park=empty_state(pair.target, book.park, width, cache_len), parked=jnp.int32(0),
                       capacity=jnp.int32(used))
    state = committed(state, params)

    def admit_rows(ahead, batch, where, i):
        adm = admission(ids, batch, where, prompt_len=p, max_new=budgets, keys=keys)
        if staged is None:
            return admit_program(pair, verify, width, sampler)(*params, ahead, adm, req.eos, ctx.judge, args)
        return admit_staged(staged, ahead, (ctx.draft.params, adm, req.eos, ctx.judge, args), warm_up=not batch,
                            admit_at=lambda n, st, drafted: admit_program(pair, staged.verifier(n), width, sampler)(
                                *params, st, adm, req.eos, ctx.judge, args, drafted))

    t0 = time.perf_counter()
    run, admissions, counters = run_ahead(
        book, state, place=place_parked, admit=admit_rows,
        advance=lambda st, free: advance(target.params, st, free, req.eos, args),
        read=lambda st: {"done": st.done, "num_new": st.num_new, "tokens": st.tokens, "steps": st.steps},
        warm=(staged if staged is not None else admit_program(pair, verify, width, sampler), p))
    counted = [got for _, got in counters]
    seconds = time.perf_counter() - t0
    out = {"tokens": np.stack([r["tokens"] for r in book.out]), "num_new": np.array([r["num_new"] for r in book.out])}
    per = rows_by_request(counters, counted, len(ids), [k for k in ("continued", *ROW_STATS) if k in counted[0]])
    out.update({k: np.stack(v) for k, v in per.items()})
    verify_passes = sum(int(got.get("verify_passes", 1)) for got in counted)
    if "rejected_at" not in out:  # sequential: a request's verification passes are its admission's
        out["own_verify_passes"] = np.zeros(len(ids), np.int64)
        for batch, got in counters:
            out["own_verify_passes"][batch] = int(got.get("verify_passes", 1))
    steps = int(run["steps"])
    res = parse_result(ctx, req, out, seconds, verify_passes=verify_passes, target_passes=verify_passes + steps,
                       continue_batch=used)
    res.stats.update(slots=used, admissions=admissions, parked=len(book.ever_parked),
                     request_passes=served_request_passes(counters, out["num_new"], out["accepted"], out["continued"]))
    return res


def served_request_passes(counters: list[tuple[list[int], dict]], num_new, accepted, continued) -> int:
    """Target passes summed over a served run's requests: the verification passes of the admission each entered
    with (all of them: a sequential admission's rows sit through its longest row's segments, as a fixed batch's
    do; an admission of single-round parse is one pass, so there this equals each request alone), then one decode
    step per token its continuation wrote after the first (which the verification pass's logits gave); a row leaves
    its slot when it ends, so it sits through no other step."""
    verifying = sum(int(got.get("verify_passes", 1)) * len(batch) for batch, got in counters)
    return verifying + int(np.sum(np.where(continued, np.maximum(np.asarray(num_new) - np.asarray(accepted) - 1, 0),
                                           0)))


def verified_rows(out: dict) -> dict:
    """A staged single round's outputs as a `Verify` returns them: with the rows that have tokens left (`live`),
    those whose next token, read at the boundary, is EOS included (that token is still emitted)."""
    return {**out, "live": (out["remaining"] > 0) | out["stop"], "first_logits": out["context"].first_logits}
