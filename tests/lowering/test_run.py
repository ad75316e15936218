"""Every mode's programs lower for TPU and CUDA from this CPU with the Pallas kernel inside (`ParseEngine.lower`).

Tiny Llama-3, Qwen2 and Qwen3 configs with real head shapes (head_dim 128, GQA), bfloat16, params as shapes only.
Each lowering is shared by the tests that read it (module-scoped caches): the matrix lowers every mode of every family
for every chip (3 x 8 x 5 = 120 lowerings, one test per family and chip); the mesh tests lower over an abstract 8-chip
TPU mesh (data=2, model=4).
"""

from __future__ import annotations

import functools

import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError, InputError
from parse_jax.lowering.export import KERNEL_CALLS
from parse_jax.lowering.launches import abstract_context, abstract_tree, mode_launches
from parse_jax.lowering.sources import shape_head
from parse_jax.models.model import Model, expected_params, unflatten
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import FAMILIES, tiny_config

TOK = Tokenizer.from_folder(TOKENIZER_DIR)
MODES = ("target", "sd", "sequential", "parse-single", "parse-multi", "eagle3", "parse+eagle3", "prefix_scores")
CHIPS = (("tpu", "v4"), ("tpu", "v5e"), ("tpu", "v5p"), ("tpu", "v6e"), ("cuda", "h100"))


def shape_model(cfg) -> Model:
    return Model(cfg, unflatten(expected_params(cfg)), TOK)


@functools.cache
def engine(family: str, heads: int = 4, kv_heads: int = 2) -> ParseEngine:
    """A one-layer target and draft of `family` with 128-wide heads (GQA heads/kv_heads) in bfloat16, as shapes."""
    cfg = tiny_config(family, vocab_size=TOK.vocab_size, head_dim=128, num_heads=heads, num_kv_heads=kv_heads,
                      hidden_size=64, num_layers=1, dtype="bfloat16", max_position_embeddings=1024)
    target, draft = shape_model(cfg), shape_model(cfg)
    target.eagle3 = shape_head(cfg)
    return ParseEngine(target, draft, ParseConfig(max_draft_tokens=16, max_prefixes=4))


@functools.cache
def lowered(family: str, mode: str, platform: str, chip: str, mesh: str | None = None, batch: int = 2):
    heads = (8, 4) if mesh else (4, 2)
    return engine(family, *heads).lower(mode, batch, 24, platform=platform, chip=chip, prompt_len=20, mesh=mesh)


@pytest.mark.parametrize("platform,chip", CHIPS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_mode_lowers_for_every_family_and_chip(family, platform, chip):
    """The whole matrix: each family's every mode on every chip (v6e: 256-wide tiles) holds its platform's kernel,
    and neither the other platform's kernel nor the interpreter's dense attention slips in. One test per (family,
    chip) lowers its eight modes, so the engine and its traced programs are shared within the test."""
    other = KERNEL_CALLS["cuda" if platform == "tpu" else "tpu"]
    for mode in MODES:
        run = lowered(family, mode, platform, chip)
        assert run.failed == {}, (mode, run.failed)
        assert run.programs, mode
        for p in run.programs:
            assert p.custom_calls.get(KERNEL_CALLS[platform], 0) >= 1, (mode, p.name, p.custom_calls)
            assert other not in p.custom_calls, (mode, p.name)


def test_a_split_single_round_lowers_its_draft_its_pass_and_its_continuation_at_every_row_bucket():
    run = lowered("qwen3", "parse-single", "tpu", "v5e", batch=3)
    assert [p.name for p in run.programs] == ["parse-single.draft", "parse-single.round", "parse-single.continue.rows1",
                                              "parse-single.continue.rows2", "parse-single.continue.rows4"]


def test_the_programs_lowered_are_those_of_the_rounds_the_run_may_take():
    """`rounds` decides parse+eagle3's programs as it decides parse's; under the defaults (schedule and rounds auto)
    a batch of 2 may run either, so both are lowered (and planned)."""
    eng = engine("qwen3")
    names = {}
    for rounds in ("multi", "single"):
        fixed = ParseEngine(eng.target, eng.draft, ParseConfig(max_draft_tokens=16, max_prefixes=4, rounds=rounds))
        run = fixed.lower("parse+eagle3", 2, 24, platform="tpu", chip="v5e", prompt_len=20)
        names[rounds] = [p.name for p in run.programs]
    assert names["multi"] == ["parse+eagle3-multi.rounds"]
    assert names["single"] == ["parse+eagle3.draft", "parse+eagle3.round", "parse+eagle3.continue.rows1",
                               "parse+eagle3.continue.rows2"]
    assert [p.name for p in lowered("qwen3", "parse+eagle3", "tpu", "v5e").programs] == names["multi"] + names["single"]
    parse = [p.name for p in lowered("qwen3", "parse", "tpu", "v5e").programs]
    assert parse[0] == "parse-multi.rounds" and "parse-single.round" in parse
    one_row = [p.name for p in lowered("qwen3", "parse", "tpu", "v5e", batch=1).programs]
    assert one_row == ["parse-multi.rounds"]  # in one slot parse runs multi round (its single round ends plainly)


@pytest.mark.parametrize("mode", ["prefix_scores", "target", "parse-single", "parse-multi"])
def test_sharded_programs_lower_for_an_8_chip_tpu_mesh(mode):
    """Verification and decode over data=2, model=4: rows split over data, heads over model; the kernel runs under
    shard_map (XLA cannot partition a Mosaic call)."""
    run = lowered("qwen3", mode, "tpu", "v5p", mesh="data=2,model=4", batch=4)
    assert run.failed == {}
    for p in run.programs:
        assert p.has_kernel, p.name
        assert p.exported.nr_devices == 8
        specs = {tuple(s.spec) for s in p.in_shardings if s is not None}
        assert ("data",) in specs, specs  # request rows
        assert (None, "model") in specs, specs  # q/k/v projections' output heads
    assert run.memory.mesh == {"data": 2, "model": 4}


def test_a_mesh_the_heads_do_not_divide_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="2 key/value heads do not divide over mesh axis 'model' of size 4"):
        engine("qwen3").lower("target", 1, 8, platform="tpu", chip="v5e", prompt_len=8, mesh="data=2,model=4")


def test_bad_lowering_requests_are_one_line_errors():
    eng = engine("qwen3")
    with pytest.raises(InputError, match="unknown mode .fast.; available: target, sd"):
        eng.lower("fast", 1, 8)
    with pytest.raises(ConfigError, match="chip h100 is a cuda chip, not a tpu one"):
        eng.lower("target", 1, 8, platform="tpu", chip="h100")
    with pytest.raises(ConfigError, match="unknown chip 'v9'"):
        eng.lower("target", 1, 8, chip="v9")
    with pytest.raises(ConfigError, match="names every axis size"):
        eng.lower("target", 1, 8, mesh="data=-1")
    with pytest.raises(InputError, match="max_position_embeddings"):
        eng.lower("target", 1, 2000, prompt_len=8)


def test_lowering_leaves_this_machine_s_programs_alone():
    """The same jitted program traced for this CPU after it was lowered for TPU holds no Mosaic call: the abstract
    mesh of the target chip is part of jax's trace cache key, so a lowering never leaks into a local run."""
    eng = engine("qwen3")
    assert lowered("qwen3", "prefix_scores", "tpu", "v5e").programs[0].has_kernel
    ctx = abstract_context(eng.context, attention_impl="pallas", mesh=None)
    req = eng.request([[1] * 20], "target", 24, 0.0, 0, 0, 1.0, None)
    launch = mode_launches(ctx, "prefix_scores", req)[0]
    text = launch.program.trace(*abstract_tree(launch.args)).lower(lowering_platforms=("cpu",)).as_text()
    assert "tpu_custom_call" not in text
