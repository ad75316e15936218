"""EAGLE-3 head training: the loss falls on a short run, a crashed run resumes, the result loads for its target."""

import json

import pytest

import parse_jax as pj
from parse_jax.train.eagle3 import Eagle3Spec, train_eagle3
from tests.fake_devices import run_on_devices


@pytest.fixture(scope="module")
def small_target():
    """The embedded target: its distributions are peaked, so there is something to learn (a random target's are
    near uniform, and the loss cannot fall below their entropy). Head training cost does not grow with its depth."""
    target, _ = pj.load_pair()
    return target


SPEC = Eagle3Spec(steps=24, batch_size=16, lr=1e-2, warmup_steps=2, unroll=2, samples=64, seq_len=40,
                  checkpoint_every=8)


def test_loss_falls_and_the_head_loads(small_target, task, tmp_path):
    losses = []
    head = train_eagle3(small_target, task, tmp_path / "run", SPEC, progress=False)
    from parse_jax.train.trainer import latest_step

    assert latest_step(tmp_path / "run" / "head_run") == 24
    loaded = pj.load_eagle3(tmp_path / "run" / "eagle3", small_target)
    assert loaded.config == head.config
    # the training history: first and last logged losses of this run

    run = json.loads((tmp_path / "run" / "head_run" / "run.json").read_text())
    assert run["phase"] == "eagle3"
    from parse_jax.speculation.eagle3 import Eagle3Config, init_head
    from parse_jax.train.eagle3 import make_loss, target_rows, teacher_arrays

    cfg = Eagle3Config.for_target(small_target.config)
    rows = target_rows(small_target, task, SPEC, tmp_path / "run", progress=False)
    feats, teacher = teacher_arrays(small_target, cfg, rows)
    batch = {"tokens": rows[:32, :-1], "prompt_len": rows[:32, -1], "features": feats[:32], "teacher": teacher[:32]}
    loss = make_loss(small_target, cfg, SPEC)
    for params in (init_head(cfg, SPEC.seed), head.params):
        losses.append(float(loss(params, batch)[0]))
    assert losses[1] < 0.8 * losses[0], losses


def test_a_crashed_run_resumes_where_it_stopped(small_target, task, tmp_path):
    class Crash(Exception):
        pass

    def crash(step):
        if step == 10:
            raise Crash

    with pytest.raises(Crash):
        train_eagle3(small_target, task, tmp_path / "run", SPEC, progress=False, on_step=crash)
    from parse_jax.train.trainer import latest_step

    assert latest_step(tmp_path / "run" / "head_run") == 8
    seen = []
    train_eagle3(small_target, task, tmp_path / "run", SPEC, progress=False, on_step=seen.append)
    assert seen[0] == 9 and seen[-1] == 24  # resumed after the last checkpoint, not from scratch


FINGERPRINTS = """
import json, sys
import parse_jax as pj
from parse_jax.checkpoints.orbax import save_model
from parse_jax.train.eagle3 import target_fingerprint
from tests.random_models import random_model
folder = sys.argv[1]
for seed in (3, 4):
    save_model(random_model("qwen3", seed=seed, hidden_size=256, intermediate_size=512), f"{folder}/m{seed}")
out = {"other weights": target_fingerprint(pj.load_model(f"{folder}/m4"))}
for mesh in (None, "data=2,model=2", "data=4"):
    model = pj.load_model(f"{folder}/m3", mesh=None if mesh is None else pj.make_mesh(mesh))
    out[str(mesh)] = target_fingerprint(model)
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_the_target_fingerprint_is_the_same_on_any_mesh(tmp_path):
    """A run's fingerprint names its target; the same weights must give it under any layout, or a head started on
    one mesh cannot resume on another (a sum of |params| on the devices differed in its last digits with the
    sharding: 85685.12591 unsharded, 85685.12726 on data=2,model=2). On 4 fake CPU devices (a subprocess: the device
    count is fixed when jax starts)."""
    out = run_on_devices(FINGERPRINTS, str(tmp_path))
    assert out["None"] == out["data=2,model=2"] == out["data=4"]
    assert out["other weights"] != out["None"]
