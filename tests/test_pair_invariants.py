"""The correctness invariants, checked on the shipped pair itself (the random-model tests check them on other
shapes): greedy sd, EAGLE-3 and PARSE with a threshold above 1 are token-identical to the target in float32; the
single-pass prefix scores equal one separate causal pass per prefix; a target sharded over 2 devices gives the
single-device tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import parse_jax as pj
from parse_jax.runtime.requests import encode_prompts
from parse_jax.train.data import Encoder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    return pj.load_pair()


@pytest.fixture(scope="module")
def prompts():
    return [p for p, _ in pj.load_task().problems(12, 21)]


def test_greedy_speculation_is_the_target_alone(pair, prompts):
    target, draft = pair
    assert target.config.dtype == "float32"
    eng = pj.ParseEngine(target, draft, pj.ParseConfig(threshold=1.0, schedule="fixed"))
    expect = eng.generate(prompts, mode="target", max_new_tokens=24)
    for mode in ("sd", "eagle3", "parse", "sequential", "parse+eagle3"):
        res = eng.generate(prompts, mode=mode, max_new_tokens=24)
        assert res.tokens == expect.tokens, mode
    assert eng.generate(prompts, mode="parse", max_new_tokens=24).stats["accepted_tokens"] == 0


def test_single_pass_scores_equal_separate_passes(pair, prompts):
    target, draft = pair
    task = pj.load_task()
    enc = Encoder(target.tokenizer, task)
    eng = pj.ParseEngine(target, draft, pj.ParseConfig(schedule="fixed"))
    drafts = pj.generate(draft, encode_prompts(target, prompts[:4]), max_new_tokens=24, temperature=1.0, seed=3)
    yes, no = eng.yes_id, eng.no_id
    for ctx, d in zip(encode_prompts(target, prompts[:4]), drafts.tokens):
        d = [t for t in d if t not in (target.tokenizer.eos_id,)]
        bounds = eng.boundaries(d)
        scores = eng.prefix_scores(ctx, d, bounds)
        for b, s in zip(bounds, scores):
            row = ctx + d[:b] + eng.suffix_ids
            last = target.logits(np.array([row]))[0, -1]
            alone = 1.0 / (1.0 + np.exp(last[no] - last[yes]))
            assert abs(s - alone) < 2e-5, (b, s, alone)
    assert enc.judge_ids[True] == yes


CHILD = r"""
import json, sys
import jax
import numpy as np
import parse_jax as pj
jax.config.update("jax_disable_most_optimizations", True)  # compiling dominates; both engines under one setting
from parse_jax.distributed.mesh import make_mesh
target, draft = pj.load_pair()
prompts = [p for p, _ in pj.load_task().problems(6, 22)]
cfg = pj.ParseConfig(max_draft_tokens=24, schedule="fixed")
single = pj.ParseEngine(target, draft, cfg)
sharded = pj.ParseEngine(target, draft, cfg, mesh=make_mesh({"data": 1, "model": 2}))
out = {}
for mode in ("target", "parse", "sd"):
    a = single.generate(prompts, mode=mode, max_new_tokens=24)
    b = sharded.generate(prompts, mode=mode, max_new_tokens=24)
    out[mode] = {"equal": a.tokens == b.tokens, "accepted": [a.stats.get("accepted_tokens"),
                                                              b.stats.get("accepted_tokens")]}
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_sharded_target_equals_the_single_device_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = tmp_path / "sharded.json"
    r = subprocess.run([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for mode, row in res.items():
        assert row["equal"], (mode, row)
    assert res["parse"]["accepted"][0] == res["parse"]["accepted"][1] > 0
