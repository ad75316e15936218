"""Continuous batching of the modes that verify once, then continue token by token (single-round parse,
sequential): slots refilled as rows finish give every prompt the tokens and counters it gets alone (greedy,
float32), in prompt order, with mixed prompt lengths, per-prompt budgets and an EOS that ends rows early; rows
verified ahead of a free slot wait in the park, in order, and take the next free slots."""

import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.modes.table import MODE_TABLE
from parse_jax.modes.verified_slots import AheadBook, AheadSlots, park_rows, place
from parse_jax.runtime.decode import generate
from parse_jax.runtime.programs import compiled_programs, setup_events
from parse_jax.runtime.slots import admission_warm_up, empty_state
from tests.modes.test_parse_multi import BUDGETS, DRAFT, PROMPTS, SETTINGS, TARGET, V, partial_engine

SINGLE = {**SETTINGS, "rounds": "single"}


@pytest.fixture(scope="module")
def engine() -> ParseEngine:
    """A threshold at which drafts are accepted part-way on these random models: both verification outcomes."""
    return partial_engine(SINGLE)


@pytest.fixture(scope="module")
def eos() -> int:
    plain = generate(TARGET, PROMPTS, max_new_tokens=14, eos_ids=[]).tokens
    return int(np.argmax(np.bincount([t for toks in plain for t in toks], minlength=V)))


def _rows(n: int, last: list[int], done: list[bool]):
    state = empty_state(TARGET.config, n, 4, 16)
    return state.replace(last=jnp.array(last, jnp.int32), done=jnp.array(done), num_new=jnp.arange(n) + 1)


def test_parked_rows_then_verified_ones_take_the_free_slots_in_order_and_the_rest_wait_in_order():
    """Slots 0 and 2 busy, 1 and 3 free, 4 past the capacity; two rows parked (100, 101): 100 takes slot 1, 101 slot
    3. Then four verified rows (200-203) into the empty park, the first and last ended at their verification, one
    slot free: 201 takes it, 202 waits, 200 and 203 go nowhere (read from the admission), and nothing else moves."""
    slots = _rows(5, [1, 2, 3, 4, 5], [False, True, False, True, True])
    park = _rows(4, [100, 101, 7, 7], [False, False, True, True])
    ahead = AheadSlots(slots=slots, park=park, parked=jnp.int32(2), capacity=jnp.int32(4))
    out, where = place(ahead)
    b, p = 5, 4
    assert where.tolist() == [1, 3, b + p, b + p] and int(out.parked) == 0
    assert out.slots.last.tolist() == [1, 100, 3, 101, 5] and out.slots.num_new.tolist() == [1, 1, 3, 2, 5]
    out = out.replace(slots=out.slots.replace(done=jnp.array([False, False, False, True, True])))  # 101 finished
    new = _rows(4, [200, 201, 202, 203], [True, False, False, True])
    out, where = place(out, new)
    assert where.tolist() == [b + p, 3, b + 0, b + p]
    assert out.slots.last.tolist() == [1, 100, 3, 201, 5] and out.slots.done.tolist() == [False] * 4 + [True]
    assert int(out.parked) == 1 and out.park.last[:1].tolist() == [202]
    assert out.park.num_new[:1].tolist() == [3]  # whole rows moved, not just their last token
    again, where = place(out)  # no slot free: the parked row stays where it is
    assert where.tolist() == [b + 0, b + p, b + p, b + p] and int(again.parked) == 1
    # three parked, one slot free: the first takes it, the other two move to the front of the park, in order
    three = AheadSlots(slots=slots.replace(done=jnp.array([False, True, False, False, True])),
                       park=_rows(4, [100, 101, 102, 7], [False, False, False, True]), parked=jnp.int32(3),
                       capacity=jnp.int32(4))
    out, where = place(three)
    assert where.tolist() == [1, b + 0, b + 1, b + p] and int(out.parked) == 2
    assert out.park.last[:2].tolist() == [101, 102] and out.park.num_new[:2].tolist() == [2, 3]
    # an admission over a stale park (rows still parked): its parked row overwrites park row 0, and the device's
    # count (1 new + 2 stale) disagrees with the host's (1), which raises (`run_ahead`)
    stale = place(out.replace(slots=out.slots.replace(done=jnp.array([False, True, False, False, True]))), new)[0]
    assert int(stale.parked) == 1 + 2 and stale.park.last[0] == 202


def test_the_book_verifies_only_with_a_slot_left_after_the_parked_rows_and_tracks_where_rows_went():
    book = AheadBook(requests=6, slots=4, capacity=3)
    assert book.park == park_rows(4) == 3 and book.to_verify() == 4  # 3 free slots: a bucket of 4 verified ahead
    book.waiting.clear(), book.waiting.extend([4, 5])
    candidates, where = [0, 1, 2, 3], np.array([0, 4, 7, 5])  # slot 0, park 0, ended, park 1
    book.settle(candidates, where, {"tokens": np.arange(4)[:, None], "num_new": np.arange(4)})
    assert book.holder == [0, -1, -1, -1] and book.parked == [1, 3] and book.out[2]["num_new"] == 2
    assert book.to_verify() == 0 and book.free_target(admitted=False) == 4 - 3 + 1  # 2 free, 2 parked: place
    book.settle([1, 3, -1], np.array([1, 2, 7]), None)
    assert book.holder == [0, 1, 3, -1] and book.parked == [] and book.to_verify() == 0  # no slot left
    book.finish({"done": np.array([True, False, False, True]), "num_new": np.arange(4)})
    assert book.out[0]["num_new"] == 0 and book.holder == [-1, 1, 3, -1] and book.to_verify() == 2
    with pytest.raises(RuntimeError, match="request 1"):  # a parked row sent nowhere is refused, not dropped
        book.settle([1, -1, -1], np.array([7, 7, 7]), None)


@pytest.mark.parametrize("mode", ["parse", "sequential"])
def test_refilled_slots_equal_each_prompt_alone(engine, eos, mode):
    alone = [engine.generate([p], mode=mode, max_new_tokens=b, eos_ids=[eos]) for p, b in zip(PROMPTS, BUDGETS)]
    assert any(len(r.tokens[0]) < b for r, b in zip(alone, BUDGETS))  # EOS ended some rows before their budget
    accepted = [r.stats["accepted_tokens"] for r in alone]
    assert 0 < sum(accepted) and any(a < len(r.tokens[0]) for a, r in zip(accepted, alone))  # partly accepted
    req = engine.request(PROMPTS, mode, max(BUDGETS), 0.0, 0, 0, 1.0, [eos])
    res = MODE_TABLE[mode].serve(engine.context, req, 3, budgets=BUDGETS)
    assert res.tokens == [r.tokens[0] for r in alone]
    assert res.stats["accepted_per_request"] == accepted
    assert res.stats["prefixes_per_request"] == [r.stats["prefixes_per_request"][0] for r in alone]
    assert res.stats["slots"] == 3 and res.stats["admissions"] > 1  # prompts entered slots freed by others
    for slots in (1, 2):  # verified ahead of the free slots (at 2, some rows wait in the park): the same tokens
        ahead = MODE_TABLE[mode].serve(engine.context, req, slots, budgets=BUDGETS)
        assert ahead.tokens == [r.tokens[0] for r in alone] and ahead.stats["accepted_per_request"] == accepted
        assert ahead.stats["parked"] == 0 if slots == 1 else ahead.stats["parked"] > 0
    # each request's verification passes: those of the admission it entered with (at least its own alone), not
    # every admission's passes for every request
    alone_checks = sum(r.stats["request_checks"] for r in alone)
    assert alone_checks <= res.stats["request_checks"] < res.stats["verify_passes"] * len(PROMPTS)
    for served in (res, ahead):  # each request's continuation passes as it counts alone, whatever its slot
        assert served.stats["continued_requests"] == sum(r.stats["continued_requests"] for r in alone)
        assert served.stats["request_passes"] - served.stats["request_checks"] == sum(
            r.stats["request_passes"] - r.stats["request_checks"] for r in alone)
        if mode == "parse":  # one verification pass per admission: its passes too
            assert served.stats["request_passes"] == sum(r.stats["request_passes"] for r in alone)


def test_generate_with_max_batch_serves_and_compiles_nothing_per_prompt(engine, eos):
    rows = [i for i, b in enumerate(BUDGETS) if b == 14]
    prompts = [PROMPTS[i] for i in rows]
    alone = [engine.generate([p], mode="parse", max_new_tokens=14, eos_ids=[eos]).tokens[0] for p in prompts]
    res = engine.generate(prompts, mode="parse", max_new_tokens=14, eos_ids=[eos], max_batch=2)
    assert res.tokens == alone and res.stats["slots"] == 2
    before = compiled_programs()
    again = engine.generate(prompts[::-1] * 2, mode="parse", max_new_tokens=14, eos_ids=[eos], max_batch=2)
    assert again.tokens == (alone[::-1] * 2)
    assert compiled_programs() - before <= 2  # at most an admission size not met before: its draft and its pass
    before = setup_events()  # the same call again runs ready programs only: nothing traced, lowered or compiled
    assert engine.generate(prompts[::-1] * 2, mode="parse", max_new_tokens=14, eos_ids=[eos],
                           max_batch=2).tokens == again.tokens
    assert setup_events() == before


@pytest.mark.parametrize("tree", [0, 3])
def test_single_round_parse_eagle3_served_equals_each_prompt_alone(tree):
    """Single-round parse+eagle3 through slots (verification at admission, EAGLE-3 rounds in the slots, the chain
    and a tree), at 1, 2 and 3 slots, with and without an EOS: each prompt's tokens and counters equal the prompt
    alone, rows verified ahead of a free slot waiting in the park."""
    from parse_jax.modes.parse_eagle3_slots import serve
    from tests.modes.test_parse_multi_eagle3 import DRAFT as E_DRAFT
    from tests.modes.test_parse_multi_eagle3 import HEAD
    from tests.modes.test_parse_multi_eagle3 import TARGET as E_TARGET

    eng = ParseEngine(E_TARGET, E_DRAFT, ParseConfig.from_flat(**SINGLE, threshold=0.5, eagle3_tree=tree),
                      eagle3=HEAD)
    parked = 0
    for eos, slot_counts in ((None, (2,)), ([], (1, 3))):  # the tokenizer's EOS ends rows early; without it rows park
        alone = [eng.generate([p], mode="parse+eagle3", max_new_tokens=b, eos_ids=eos)
                 for p, b in zip(PROMPTS, BUDGETS)]
        req = eng.request(PROMPTS, "parse+eagle3", max(BUDGETS), 0.0, 0, 0, 1.0, eos)
        for slots in slot_counts:  # verified ahead of the free slots
            with admission_warm_up():  # every admission size and the placement set up first, empty: nothing moves
                res = serve(eng.context, req, slots, budgets=BUDGETS)
            before = setup_events()
            again = serve(eng.context, req, slots, budgets=BUDGETS)  # ready programs only; the same run
            assert setup_events() == before and again.tokens == res.tokens
            assert (again.stats["target_passes"], again.stats["parked"]) == (res.stats["target_passes"],
                                                                            res.stats["parked"])
            assert res.tokens == [r.tokens[0] for r in alone]
            assert sum(res.stats["accepted_per_request"]) > 0 and res.stats["eagle3_accepted_tokens"] > 0  # both
            assert res.stats["accepted_per_request"] == [r.stats["accepted_tokens"] for r in alone]
            assert res.stats["eagle3_accepted_tokens"] == sum(r.stats["eagle3_accepted_tokens"] for r in alone)
            for key in ("request_passes", "continued_requests"):  # each request's passes as it counts alone
                assert res.stats[key] == sum(r.stats[key] for r in alone), key
            assert res.stats["slots"] == slots and res.stats["admissions"] > 1
            assert slots > 1 or res.stats["parked"] == 0  # one slot: no park
            parked += res.stats["parked"]
    assert parked > 0  # rows waited in the park and took later slots


def test_a_served_single_round_sets_up_only_the_block_lengths_its_admissions_take(engine, eos):
    """Verified at admission in two programs (the draft, then a pass over the one block length it needs, read by the
    host): a run sets up the lengths its blocks took, not all of them (one program over every length held them all,
    each to load), gives each prompt its tokens alone, and a warm-up sets every length up. Its own prefix count, so
    that no other test's run set these programs up."""
    from parse_jax.modes.context import PairSpec
    from parse_jax.modes.parse import SingleRound, single_shape, staged_single_round
    from parse_jax.modes.verified_slots import admit_program
    from parse_jax.runtime.programs import bucket
    from parse_jax.verify.round import pick_length

    engine = ParseEngine(TARGET, DRAFT, ParseConfig(**{**SINGLE, "max_prefixes": 5}, threshold=engine.config.threshold))
    prompts, budget = PROMPTS[:4], 14
    runs = [engine.generate([p], mode="parse", max_new_tokens=budget, eos_ids=[eos]) for p in prompts]
    alone, blocks = [r.tokens[0] for r in runs], [r.stats["verify_tokens"] for r in runs]  # one pass each
    req = engine.request(prompts, "parse", budget, 0.0, 0, 0, 1.0, [eos])
    ctx, sampler = engine.context, req.sampling.sampler
    shape = single_shape(ctx, bucket(max(len(x) for x in req.ids)), req.max_new)
    staged = staged_single_round(SingleRound(PairSpec.of(ctx), ctx.round_spec, shape, sampler))
    width = shape.draft_new + shape.num_new

    def set_up() -> set[int]:
        return {n for n in staged.lengths if admit_program(PairSpec.of(ctx), staged.verifier(n), width,
                                                           sampler)._cache_size()}

    assert set_up() == set()
    res = MODE_TABLE["parse"].serve(ctx, req, 2)
    assert res.tokens == alone
    # an admission's pass takes the length of its longest row's block
    assert pick_length(staged.lengths, max(blocks)) in set_up()
    assert set_up() <= {pick_length(staged.lengths, n) for n in blocks} and len(set_up()) < len(staged.lengths)
    with admission_warm_up():
        assert MODE_TABLE["parse"].serve(ctx, req, 2).tokens == alone
    assert set_up() == set(staged.lengths)
