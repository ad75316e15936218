"""The memory plan: an 8B bfloat16 target against a 16 GB chip, the refusal line, and the estimate against XLA's own
buffer assignment (`compiled.memory_analysis()` on this CPU)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError
from parse_jax.lowering.chips import chip
from parse_jax.lowering.launches import abstract_context, abstract_tree, mode_launches
from parse_jax.lowering.memory import MemoryGuard, check_fits, device_plan, plan_memory, weight_bytes
from parse_jax.lowering.run import check_memory
from parse_jax.lowering.sources import shape_head, shape_model
from parse_jax.models.model import Model, expected_params, unflatten
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.modes.context import PairSpec
from parse_jax.modes.parse import SingleRound, single_shape, staged_single_round
from parse_jax.modes.verified_slots import AheadSlots, admit_program, draft_program, park_rows
from parse_jax.runtime.programs import FETCHES, bucket
from parse_jax.runtime.slots import admission, empty_state
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import random_model, tiny_config

TOK = Tokenizer.from_folder(TOKENIZER_DIR)


@functools.cache
def big_engine(draft: str | None = None) -> ParseEngine:
    return ParseEngine(shape_model("llama3-8b"), shape_model(draft) if draft else None, ParseConfig())


def plan(engine, mode, batch, max_new, target_chip="v5e", mesh=None, prompt_len=64):
    """The plan `parse-jax lower` makes: attention_impl "pallas" (the chip's kernel, no dense scores)."""
    req = engine.request([[1] * prompt_len] * batch, "target" if mode == "target" else "parse", max_new, 0.0, 0, 0,
                         1.0, None)
    ctx = abstract_context(engine.context, attention_impl="pallas", mesh=None)
    return plan_memory(ctx, mode, req, chip(target_chip), mesh)


def test_an_8b_target_at_64_x_8192_is_refused_on_a_16_gb_chip_and_1_x_2048_fits():
    eng = big_engine()
    weights = weight_bytes(eng.target.config, {"data": 1, "model": 1})
    assert weights == eng.target.config.num_params * 2  # bfloat16: every param counted once
    small = plan(eng, "target", 1, 2048)
    assert small.fits, small.line()
    assert small.weights == weights
    big = plan(eng, "target", 64, 8192)
    assert not big.fits
    # 64 rows x 32 layers x 2 x 8 KV heads x 128 x 2 bytes per slot, 12288 slots (prompt + budget bucket)
    assert big.caches == 64 * 32 * 2 * 8 * 128 * 2 * 12288
    line = big.line()
    assert "\n" not in line
    assert line.startswith("batch 64 x 64 prompt + 8192 new tokens does not fit a v5e chip (17.2 GB)")
    assert f"weights {weights / 1e9:.2f} GB" in line and "KV caches 103.08 GB" in line
    # no batch or budget holds 16 GB of weights and a cache on a 17.2 GB chip: only a mesh does
    assert line.endswith("what would fit: a mesh data=1,model=8"), line
    with pytest.raises(ConfigError, match="does not fit a v5e chip"):
        check_fits(big)
    # on a 32 GB v6e the same run fits at a smaller batch or a shorter budget
    options = plan(eng, "target", 64, 8192, "v6e").alternatives
    assert options[0].startswith("batch ") and options[1].startswith("max_new_tokens "), options


@pytest.mark.parametrize("target_chip", ["v5e", "v6e"])
def test_what_would_fit_does_fit(target_chip):
    eng = big_engine()
    big = plan(eng, "target", 64, 8192, target_chip)
    assert big.alternatives
    for option in big.alternatives:
        if option.startswith("batch "):
            assert plan(eng, "target", int(option.split()[1]), 8192, target_chip).fits
        elif option.startswith("max_new_tokens "):
            assert plan(eng, "target", 64, int(option.split()[1]), target_chip).fits
        else:
            d, m = (int(x.split("=")[1]) for x in option.removeprefix("a mesh ").split(","))
            assert plan(eng, "target", 64, 8192, target_chip, mesh={"data": d, "model": m}).fits


def test_a_mesh_splits_weights_over_model_and_caches_over_both_axes():
    eng = big_engine("llama3-1b")
    one = plan(eng, "parse-single", 8, 1024, "v6e")
    mesh = plan(eng, "parse-single", 8, 1024, "v6e", mesh={"data": 2, "model": 4})
    # the 8B target splits over model; the 1B draft (32 heads, 8 KV heads) divides too
    assert mesh.per_model["target"]["weights"] < one.per_model["target"]["weights"] / 3.9
    assert mesh.caches == pytest.approx(one.caches / 8, rel=1e-9)
    assert set(one.per_model) == {"target", "draft"}


class Device:
    """What `jax.devices()[0]` answers on an accelerator whose allocator offers `bytes_limit` bytes (default: a TPU
    v6e's 32 GB); counts how often it was asked."""

    def __init__(self, bytes_limit: int = 32 * 10**9, device_kind: str = "TPU v6 lite", platform: str = "tpu"):
        self.bytes_limit, self.device_kind, self.platform, self.asked = bytes_limit, device_kind, platform, 0

    def memory_stats(self):
        self.asked += 1
        return {"bytes_limit": self.bytes_limit}


def test_a_device_without_room_refuses_the_run_in_one_line():
    """`check_memory` on a device whose allocator offers 32 GB, as `memory_stats()` reports it on a TPU v6e."""
    eng = big_engine("llama3-1b")
    with pytest.raises(ConfigError, match=r"^batch 64 x 5 prompt \+ 8192 new tokens does not fit a v6e chip "
                                          r"\(32\.0 GB\): weights 18\.53 GB \+ KV caches"):
        check_memory(eng, [[1, 2, 3, 4, 5]] * 64, "parse", 8192, device=Device())
    ok = check_memory(eng, [[1, 2, 3, 4, 5]], "parse", 512, device=Device())
    assert ok is not None and ok.fits and ok.capacity == 32 * 10**9
    assert set(ok.per_model) == {"target", "draft"}


def test_this_cpu_has_no_plan():
    assert device_plan(big_engine().context, "target",
                       big_engine().request([[1]], "target", 8, 0.0, 0, 0, 1.0, None)) is None


@functools.cache
def cpu_engine() -> ParseEngine:
    cfg = tiny_config("qwen3", vocab_size=4096, head_dim=64, num_heads=8, num_kv_heads=4, hidden_size=256,
                      intermediate_size=512, num_layers=2, max_position_embeddings=4096)
    target = Model(cfg, unflatten(expected_params(cfg)), TOK)
    draft = Model(cfg.replace(num_layers=1), unflatten(expected_params(cfg.replace(num_layers=1))), TOK)
    target.eagle3 = shape_head(cfg)
    return ParseEngine(target, draft, ParseConfig(max_draft_tokens=32, max_prefixes=4, rounds="single"))


@pytest.mark.parametrize("mode,batch,max_new", [("target", 8, 1024), ("prefix_scores", 4, 256),
                                                 ("parse-single", 1, 128), ("sd", 4, 256), ("parse-multi", 1, 128)])
def test_the_estimate_is_within_10_percent_of_xla(mode, batch, max_new):
    """The programs compiled for this CPU (attention_impl "xla": dense scores, as the plan counts them there):
    arguments + outputs + temporaries - aliased, as XLA's buffer assignment reports them."""
    eng = cpu_engine()
    ctx = abstract_context(eng.context, attention_impl="xla", mesh=None)
    rounds = "multi" if mode == "parse-multi" else "single"
    ctx = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, rounds=rounds))
    run = {"target": "target", "sd": "sd"}.get(mode, "parse")
    req = eng.request([[1] * 100] * batch, run, max_new, 0.0, 0, 0, 1.0, None)
    launch = mode_launches(ctx, mode, req)[0]
    stats = launch.program.trace(*abstract_tree(launch.args)).lower().compile().memory_analysis()
    xla = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
           - stats.alias_size_in_bytes)
    estimate = plan_memory(ctx, mode, req, chip("v5e")).total
    assert abs(estimate / xla - 1) < 0.10, (estimate, xla)


def test_a_served_admission_that_verifies_ahead_is_within_2_percent_of_xla():
    """The largest program of single-round parse served through 4 slots over more prompts: its admission at the
    longest block, which holds the slots and the park of verified rows (arguments, donated) while it verifies a slot
    bucket of drafted prompts (their caches and passes: temporaries) and places the rows, beside the draft's weights
    (resident; the pass reads none). The plan of that served run counts the target's cache 3B - 1 rows deep; the
    plan of a fixed batch of 4 (B rows) falls short of XLA's figure by more than the tolerance. The plan also counts
    the draft's cache and activations, which live in the draft's program, not the pass's: small beside the target's
    here (a 1-layer draft), so the plan is the larger of the two within the tolerance."""
    eng = cpu_engine()
    ctx = abstract_context(eng.context, attention_impl="xla", mesh=None)
    slots = 4
    req = eng.request([[1] * 100] * (3 * slots), "parse", 128, 0.0, 0, 0, 1.0, None)
    pair, sampler = PairSpec.of(ctx), req.sampling.sampler
    shape = single_shape(ctx, bucket(100), req.max_new)
    staged = staged_single_round(SingleRound(pair, ctx.round_spec, shape, sampler))
    width = shape.draft_new + shape.num_new
    admit = admit_program(pair, staged.verifier(staged.lengths[-1]), width, sampler)
    state = jax.eval_shape(lambda: AheadSlots(
        slots=empty_state(ctx.target.config, slots, width, shape.cache_len),
        park=empty_state(ctx.target.config, park_rows(slots), width, shape.cache_len), parked=jnp.int32(0),
        capacity=jnp.int32(slots)))
    adm = admission(req.ids, list(range(slots)), np.arange(slots, dtype=np.int32), prompt_len=bucket(100),
                    max_new=[req.max_new] * len(req.ids), keys=req.sampling.keys(len(req.ids)))
    drafted = jax.eval_shape(draft_program(staged.draft).jitted,
                             *abstract_tree((ctx.draft.params, adm, req.eos, ctx.judge, req.sampling.args(1))))[0]
    args = abstract_tree((ctx.target.params, ctx.draft.params, state, adm, req.eos, ctx.judge, req.sampling.args(1),
                          drafted))
    stats = admit.trace(*args).lower().compile().memory_analysis()
    xla = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
           - stats.alias_size_in_bytes + weight_bytes(ctx.draft.config, {}))
    served = plan_memory(ctx, "parse", req, chip("v5e"), batch=slots)
    fixed = plan_memory(ctx, "parse", dataclasses.replace(req, ids=req.ids[:slots]), chip("v5e"))
    assert served.per_model["target"]["kv_cache"] == fixed.per_model["target"]["kv_cache"] * (3 * slots - 1) // slots
    assert abs(served.total / xla - 1) < 0.02, (served.total, fixed.total, xla)
    assert fixed.total < 0.85 * xla, (fixed.total, xla)  # the plan of its slots alone falls outside that band


def test_served_plans_count_the_slots_and_an_admission_and_either_rounds_the_larger_of_both():
    big = big_engine("llama3-1b")
    eng = ParseEngine(big.target, big.draft, ParseConfig(), eagle3=shape_head(big.target.config))
    ctx = abstract_context(eng.context, attention_impl="pallas", mesh=None)
    req = eng.request([[1] * 64] * 32, "parse", 1024, 0.0, 0, 0, 1.0, None)
    kv = lambda mode, c=ctx, r=req, batch=None: {  # noqa: E731
        k: v["kv_cache"] for k, v in plan_memory(c, mode, r, chip("v6e"), batch=batch).per_model.items()}
    eight = dataclasses.replace(req, ids=req.ids[:8])
    for mode in ("target", "sd"):  # served: the slots and an admission's rows, every model
        fixed, served = kv(mode, r=eight), kv(mode, batch=8)
        assert served == {k: 2 * v for k, v in fixed.items()}
    # verifying ahead (sequential whatever `rounds` says; parse+eagle3 single round): the target's and the head's
    # cache 3B - 1 rows (slots, park, admission), the draft's only the admission's
    single = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, rounds="single"))
    for mode, c in (("sequential", ctx), ("parse+eagle3", single)):
        fixed, served = kv(mode, c=c, r=eight), kv(mode, c=c, batch=8)
        assert served == {k: v if k == "draft" else v * 23 // 8 for k, v in fixed.items()}, mode
        assert set(served) == ({"target", "draft", "eagle3"} if mode == "parse+eagle3" else {"target", "draft"})
    multi = kv("parse+eagle3", batch=8)  # multi round: every cache at 2B, the head's too
    assert ctx.config.rounds == "multi" and set(multi) == {"target", "draft", "eagle3"}
    assert multi == {k: 2 * v for k, v in kv("parse+eagle3", r=eight).items()}
    for batch in (None, 8):  # the whole batch, and served through 8 slots
        plans = {r: plan_memory(ctx, "parse", req, chip("v6e"), batch=batch, rounds=r).total
                 for r in (("multi",), ("single",), ("multi", "single"))}
        assert plans[("multi", "single")] == max(plans[("multi",)], plans[("single",)])
        assert plans[("multi",)] != plans[("single",)]


@functools.cache
def small_engine() -> ParseEngine:
    """A real (random) qwen3 target and llama3 draft on this CPU."""
    models = [random_model(family, seed, vocab_size=TOK.vocab_size) for family, seed in (("qwen3", 40), ("llama3", 41))]
    target, draft = (Model(m.config, m.params, TOK) for m in models)
    return ParseEngine(target, draft, ParseConfig(max_draft_tokens=12, rounds="single", schedule="fixed"))


PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :", "( 1 + 1 ) :"]


def test_generate_refuses_a_run_the_device_cannot_hold_before_running_anything():
    """`ParseEngine.generate` plans against its device (here one whose allocator offers room for this run served
    through one slot and no more): the whole batch at once is refused in one line naming the sizes and what would
    fit, before any program ran; the run under max_batch=1 runs and gives the tokens of a run without the check."""
    eng = small_engine()
    req = eng.request(PROMPTS, "parse", 16, 0.0, 0, 0, 1.0, None)
    one = MemoryGuard(Device()).plan(eng.context, "parse", req, batch=1)  # served through one slot: sizes only
    reference = eng.generate(PROMPTS, "parse", 16)  # this CPU reports no capacity: no plan, no refusal
    assert eng.memory_guard.plan(eng.context, "parse", req) is None
    device = Device(bytes_limit=one.total + 1, device_kind="Fake accelerator", platform="fake")
    eng.memory_guard = MemoryGuard(device)
    try:
        fetches = FETCHES[0]
        with pytest.raises(ConfigError) as refused:
            eng.generate(PROMPTS, "parse", 16)
        assert FETCHES[0] == fetches  # nothing ran
        line = str(refused.value)
        assert "\n" not in line
        longest = max(len(p) for p in req.ids)
        assert line.startswith(f"batch 4 x {longest} prompt + 16 new tokens does not fit a Fake accelerator chip "
                               f"({(one.total + 1) / 1e6:.1f} MB): weights {one.weights / 1e6:.2f} MB + KV caches")
        assert "weights " in line and " KV caches " in line and " activations " in line
        assert "what would fit: batch " in line
        assert eng.generate(PROMPTS, "parse", 16, max_batch=1).tokens == reference.tokens  # one row at a time fits
    finally:
        eng.memory_guard = MemoryGuard()
    assert device.asked == 1  # the device is asked once


def test_generate_plans_every_rounds_its_schedule_may_take():
    """With `rounds="auto"` the schedule may run multi or single round: served through 2 slots with a long budget,
    single round (3B - 1 target cache rows) needs more than multi round (whose context the engine holds). On a
    device with room for multi round only, generate refuses; with `rounds="multi"` given, the same call runs."""
    draft = random_model("llama3", 41, vocab_size=TOK.vocab_size, num_layers=1, hidden_size=32, intermediate_size=64,
                         num_heads=2, num_kv_heads=1, max_position_embeddings=2048)
    target = random_model("qwen3", 40, vocab_size=TOK.vocab_size, num_layers=4, max_position_embeddings=2048)
    pair = (Model(target.config, target.params, TOK), Model(draft.config, draft.params, TOK))
    auto = ParseEngine(*pair, ParseConfig(max_draft_tokens=12))
    assert auto.config.rounds == "auto" and auto.config.schedule == "auto" and auto.context.config.rounds == "multi"
    req = auto.request(PROMPTS, "parse", 512, 0.0, 0, 0, 1.0, None)
    plans = {r: MemoryGuard(Device()).plan(auto.context, "parse", req, 2, (r,)).total for r in ("multi", "single")}
    assert plans["single"] > plans["multi"]
    device = Device(bytes_limit=plans["multi"] + 1, device_kind="Fake accelerator", platform="fake")
    auto.memory_guard = MemoryGuard(device)
    with pytest.raises(ConfigError, match="does not fit a Fake accelerator chip"):
        auto.generate(PROMPTS, "parse", 512, max_batch=2)
    given = ParseEngine(*pair, ParseConfig(max_draft_tokens=12, rounds="multi"))
    given.memory_guard = MemoryGuard(device)
    assert len(given.generate(PROMPTS, "parse", 512, max_batch=2).tokens) == len(PROMPTS)


def test_the_guard_plans_once_per_run_shape_and_not_at_all_on_this_cpu():
    eng = small_engine()
    guard = MemoryGuard(Device())
    req = eng.request(PROMPTS, "parse", 16, 0.0, 0, 0, 1.0, None)
    first = guard.check(eng.context, "parse", req)
    assert first is not None and first.fits
    assert guard.check(eng.context, "parse", req) is first  # cached
    assert guard.check(eng.context, "parse", req, batch=2) is not first  # another shape: another plan
    assert guard.check(eng.context, "sd", req) is not first
    assert guard.device.asked == 1
    cpu = MemoryGuard()
    assert cpu.check(eng.context, "parse", req) is None and cpu.target() is None
