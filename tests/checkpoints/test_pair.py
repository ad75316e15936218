"""The embedded pair shipped in the package: it loads with no argument, matches its recipe, and passes a quick
version of the pair's quality bars on 100 held-out problems (the full bars, on 1000, are in README and
benchmarks/results/pair_default_eval.md)."""

import shutil

import jax
import numpy as np
import pytest

import parse_jax as pj
from parse_jax.checkpoints.pair import PAIR_DIR
from parse_jax.errors import CheckpointError
from parse_jax.train.evaluate import accuracy, judge_auroc, solve_many, token_diff_fraction
from parse_jax.train.grow import grown_config
from parse_jax.train.pipeline import model_config
from parse_jax.train.recipe import load_recipe


@pytest.fixture(scope="module")
def pair():
    return pj.load_pair()


def test_the_shipped_pair_is_the_recipes_weight_bound_and_small(pair):
    target, draft = pair
    recipe = load_recipe("pair_default")
    narrow = model_config(recipe.target_model, target.tokenizer)
    assert target.config == grown_config(narrow, model_config(recipe.grow.model, target.tokenizer))
    assert draft.config == model_config(recipe.draft_model, draft.tokenizer)
    # float32 weights well beyond 1.5x the 32 MB L3 of the CPUs it was sized on: a one-token step reads them all
    assert target.config.num_params * 4 > 1.5 * 32 * 2**20 and target.config.num_params >= 10e6
    assert target.config.dtype == "float32"  # stored in bfloat16, loaded as float32
    size = sum(f.stat().st_size for f in PAIR_DIR.rglob("*") if f.is_file())
    assert size < 100e6
    for m in pair:
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(m.params))


def test_quick_quality_bars_on_100_held_out_problems(pair):
    target, draft = pair
    task = pj.load_task()
    t_acc, t_out = accuracy(target, task, 100)
    d_acc, d_out = accuracy(draft, task, 100)
    assert t_acc >= 0.97  # bar on 1000: >= 99%; 100 problems leave a few points of sampling error
    assert 0.7 <= d_acc <= 0.96  # bar on 1000: 75% to 92%
    assert t_acc > d_acc
    assert token_diff_fraction(task, d_out, t_out) > 0.2  # correct drafts that differ token-wise from the target
    prompts = [p for p, _ in task.problems(100, 0)]
    sampled = solve_many(draft, task, prompts, temperature=1.0, seed=12345)
    res = judge_auroc(target, task, list(zip(prompts, sampled)), n_synthetic=100)
    assert res["auroc"] >= 0.95, res  # bar on 1000: >= 0.98
    assert res["auroc_draft"] >= 0.97, res  # bar on 1000: >= 0.99 on real draft outputs


def test_the_default_config_fits_the_pair(pair):
    target, draft = pair
    eng = pj.ParseEngine(target, draft, pj.ParseConfig(schedule="fixed"))  # PARSE at batch 8, its settings default
    task = pj.load_task()
    prompts = [p for p, _ in task.problems(8, 3)]
    res = eng.generate(prompts, mode="parse", max_new_tokens=32)
    assert res.stats["verify_passes"] >= 1 and res.stats["accepted_tokens"] > 0
    assert np.mean([task.grade(p, t) for p, t in zip(prompts, res.texts)]) >= 0.75


def test_a_pair_folder_loads_as_the_embedded_pair_does(pair, pair_dir, tiny_hf, tmp_path):
    """load_pair(DIR) and load_pair() agree: parse-jax checkpoints stored in bfloat16 (the shipped target, the
    docs/training.md recipe's pair_final) load as float32 unless dtype says otherwise; HF folders as load_model
    loads them; load_model itself keeps a checkpoint's stored dtype."""
    assert all(m.config.dtype == "float32" for m in pj.load_pair(PAIR_DIR)) and pair[0].config.dtype == "float32"
    half = tmp_path / "pair_final"
    for name in ("target", "draft"):
        pj.save_model(pj.load_model(pair_dir / name, dtype="bfloat16"), half / name)
    assert pj.load_model(half / "target").config.dtype == "bfloat16"
    target, draft = pj.load_pair(half)
    assert (target.config.dtype, draft.config.dtype) == ("float32", "float32")
    assert {x.dtype for m in (target, draft) for x in jax.tree.leaves(m.params)} == {np.dtype("float32")}
    assert all(m.config.dtype == "bfloat16" for m in pj.load_pair(half, dtype="bfloat16"))
    hf = tmp_path / "hf_pair"
    for name in ("target", "draft"):
        shutil.copytree(tiny_hf("qwen3", dtype="bfloat16"), hf / name)
    stored = pj.load_model(hf / "target").config.dtype
    assert stored == "bfloat16"  # config.json's torch_dtype, as load_hf reads a HF folder
    assert [m.config.dtype for m in pj.load_pair(hf)] == [stored, stored]


def test_a_pair_folder_keeps_its_stored_dtype_on_an_accelerator(pair_dir, tmp_path, monkeypatch):
    """On a GPU or TPU a parse-jax checkpoint keeps the dtype it was stored in (a large model's float32 copy may not
    fit); the embedded pair still loads as float32."""
    half = tmp_path / "pair_final"
    for name in ("target", "draft"):
        pj.save_model(pj.load_model(pair_dir / name, dtype="bfloat16"), half / name)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert [m.config.dtype for m in pj.load_pair(half)] == ["bfloat16", "bfloat16"]
    assert pj.load_pair()[0].config.dtype == "float32"


def test_a_folder_without_a_pair_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="not a pair folder.*target/ or draft/"):
        pj.load_pair(tmp_path)


def test_the_shipped_eagle3_head_is_lossless_and_drafts_well(pair):
    """The pair ships an EAGLE-3 head (parse_jax/assets/pair/eagle3): loaded with the pair, greedy decoding with it
    equals the target's, and it drafts several tokens per target pass (bar on 500 problems: tau >= 2.5)."""
    target, draft = pair
    assert target.eagle3 is not None
    task = pj.load_task()
    from parse_jax.train.data import Encoder

    enc = Encoder(target.tokenizer, task)
    ids = [enc.prompt_ids(p) for p, _ in task.problems(64, 3)]
    expect = pj.generate(target, ids, max_new_tokens=24)
    res = pj.eagle3_generate(target, target.eagle3, ids, gamma=4, max_new_tokens=24)
    assert res.tokens == expect.tokens
    per_row_passes = expect.stats["target_passes"]  # the batch's passes alone, a row's tokens + 1 at most
    assert res.stats["target_passes"] * 2 <= per_row_passes  # >= 2 tokens per target pass on these rows


def test_parse_eagle3_continues_like_eagle3_from_the_accepted_prefix(pair):
    """parse+eagle3 builds the head's context from the verification pass's features; starting EAGLE-3 from the
    accepted prefix with its own prefill must give the same tokens and accept the same proposals (the trained head
    accepts most of them, so a wrong feature, position or length shows in the count)."""
    target, draft = pair
    task = pj.load_task()
    prompts = [p for p, _ in task.problems(8, 5)]
    eng = pj.ParseEngine(target, draft, pj.ParseConfig(threshold=0.0, max_draft_tokens=12, schedule="fixed",
                                                       rounds="single"))
    res = eng.generate(prompts, mode="parse+eagle3", max_new_tokens=24)
    from parse_jax.runtime.requests import encode_prompts

    ids = encode_prompts(target, prompts)
    expect = 0
    for i, p in enumerate(ids):
        acc = res.stats["accepted_per_request"][i]
        assert acc == 12  # threshold 0: the whole draft
        alone = pj.eagle3_generate(target, target.eagle3, [p + res.tokens[i][:acc]], gamma=5,
                                   max_new_tokens=24 - acc)
        assert res.tokens[i][acc:] == alone.tokens[0]
        expect += alone.stats["accepted_tokens"]
    assert res.stats["eagle3_accepted_tokens"] == expect > 0
