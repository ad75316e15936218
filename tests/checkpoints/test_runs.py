"""`pj.load_model` on Orbax CheckpointManager folders written the way a training loop writes them (optax state
beside the params, two steps): the right step's params, found automatically, and one-line errors for bad input."""

import dataclasses
import json
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from parse_jax import load_model, make_mesh
from parse_jax.checkpoints.hf import hf_config_dict
from parse_jax.checkpoints.orbax import params_equal, save_model
from parse_jax.checkpoints.runs import resolve_step
from parse_jax.distributed.sharded import ShardedModel
from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.tasks import TOKENIZER_DIR
from tests.checkpoints.runs_fixture import write_run
from tests.fake_devices import run_on_devices
from tests.random_models import random_model, tiny_config

STEPS = (10, 30)
IDS = np.array([[5, 17, 3, 88, 41, 2, 9], [60, 1, 1, 33, 7, 70, 12]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run folder, config, {step: params}); the CheckpointManager folder is RUN/ckpt, as this project's trainer
    lays it out, and RUN/run.json carries the config the way the trainer writes it."""
    model = random_model("qwen3", seed=7)
    folder = tmp_path_factory.mktemp("run")
    return folder, model.config, write_run(folder, model, STEPS, run_json=True)


def _logits(cfg, params):
    return Model(cfg, params).logits(IDS)


def test_latest_and_explicit_step_give_the_params_saved(run):
    folder, cfg, saved = run
    assert not params_equal(saved[10], saved[30])  # the steps differ, so picking the wrong one shows
    latest = load_model(folder)
    assert latest.loaded_from == {"path": str(folder / "ckpt"), "step": 30, "params_path": "state/params"}
    assert latest.config == cfg and params_equal(latest.params, saved[30])
    np.testing.assert_array_equal(latest.logits(IDS), _logits(cfg, saved[30]))
    first = load_model(folder, step=10)
    assert first.loaded_from["step"] == 10 and params_equal(first.params, saved[10])
    np.testing.assert_array_equal(first.logits(IDS), _logits(cfg, saved[10]))
    # the CheckpointManager folder itself, or one step's folder, say the same
    assert params_equal(load_model(folder / "ckpt", 10).params, saved[10])
    assert params_equal(load_model(folder / "ckpt" / "10").params, saved[10])
    assert resolve_step(folder) == 30 and resolve_step(folder, 10) == 10


def test_config_from_a_model_folder_or_a_model_config(run, tmp_path):
    folder, cfg, saved = run
    plain = tmp_path / "ckpt"
    shutil.copytree(folder / "ckpt", plain)  # no run.json: the user names the config
    with pytest.raises(ConfigError, match="no model config for the checkpoints in .*config_from="):
        load_model(plain)
    bare = load_model(plain, config_from=cfg)
    assert params_equal(bare.params, saved[30]) and bare.tokenizer is None
    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    m = load_model(plain, config_from=Model(cfg, saved[10], tok))  # the model being fine-tuned: config + tokenizer
    assert m.tokenizer is tok and params_equal(m.params, saved[30])
    exported = save_model(random_model("qwen3", seed=1), tmp_path / "export")  # same shapes, other weights
    m = load_model(plain, step=10, config_from=exported)
    assert m.config == cfg and params_equal(m.params, saved[10])
    (plain / "config.json").write_text(json.dumps(hf_config_dict(cfg)))  # a HF config kept beside the steps
    m = load_model(plain)
    assert m.config == cfg and params_equal(m.params, saved[30])


def test_a_step_that_does_not_exist_lists_the_steps(run):
    folder, _, _ = run
    with pytest.raises(CheckpointError, match=r"^step 20 not found in .*ckpt; steps: 10, 30$"):
        load_model(folder, step=20)
    with pytest.raises(CheckpointError, match="step 20 not found"):
        resolve_step(folder, 20)  # what the CLI checks before it starts a results file


def test_a_step_being_written_is_refused_and_never_read(run, tmp_path):
    folder, cfg, saved = run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    # Orbax writes a step into `<step>.orbax-checkpoint-tmp-<time>` and renames it when complete
    shutil.copytree(copy / "ckpt" / "30", copy / "ckpt" / "300.orbax-checkpoint-tmp-1712345678")
    # and an item of a step folder that is already in place (non-atomic file systems)
    shutil.copytree(copy / "ckpt" / "30", copy / "ckpt" / "400")
    (copy / "ckpt" / "400" / "state").rename(copy / "ckpt" / "400" / "state.orbax-checkpoint-tmp-1712345679")
    # where renames are not atomic, Orbax's commit marker is written last
    shutil.copytree(copy / "ckpt" / "30", copy / "ckpt" / "500")
    (copy / "ckpt" / "500" / "commit_success.txt").unlink()
    latest = load_model(copy)
    assert latest.loaded_from["step"] == 30 and params_equal(latest.params, saved[30])
    for step in (300, 400, 500):
        with pytest.raises(CheckpointError, match=rf"^step {step} in .* is still being written"):
            load_model(copy, step=step)


@pytest.mark.parametrize("naming, names", [
    ({"step_prefix": "step"}, ["step_3", "step_12"]),
    ({"step_format_fixed_length": 6}, ["000003", "000012"]),
    ({"step_prefix": "ckpt", "step_format_fixed_length": 4}, ["ckpt_0003", "ckpt_0012"]),
])
def test_runs_in_orbax_step_name_formats_load_at_latest_and_at_a_step(tmp_path, naming, names):
    """The user's CheckpointManager names steps with a prefix and/or zero padding: found with Orbax's own step
    utilities, at the latest step and at an explicit one; a temporary step in that format is skipped."""
    from etils import epath

    model = random_model("qwen3", seed=4)
    saved = write_run(tmp_path / "c", model, steps=(3, 12), naming=naming)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(names)  # Orbax's names, as configured
    shutil.copytree(tmp_path / "c" / names[1], tmp_path / "c" / f"{names[1][:-2]}99.orbax-checkpoint-tmp-17123")
    latest = load_model(tmp_path / "c", config_from=model.config)
    assert latest.loaded_from["step"] == 12 and params_equal(latest.params, saved[12])
    first = load_model(epath.Path(tmp_path / "c"), step=3, config_from=model.config)
    assert first.loaded_from["step"] == 3 and params_equal(first.params, saved[3])
    assert params_equal(load_model(tmp_path / "c" / names[0], config_from=model.config).params, saved[3])
    assert resolve_step(tmp_path / "c") == 12 and resolve_step(str(tmp_path / "c"), 3) == 3
    with pytest.raises(CheckpointError, match=r"still being written"):
        load_model(tmp_path / "c", step=int(names[1][:-2].rpartition("_")[2] + "99"), config_from=model.config)
    with pytest.raises(CheckpointError, match=r"step 7 not found in .*; steps: 3, 12"):
        load_model(tmp_path / "c", step=7, config_from=model.config)


def test_several_candidate_params_trees_are_listed(tmp_path):
    model = random_model("qwen3", seed=8)
    ema = lambda p: {"ema": {"params": jax.tree.map(lambda x: 0.5 * x, p)}}  # noqa: E731
    saved = write_run(tmp_path / "ckpt", model, steps=(3,), extra=ema)
    with pytest.raises(CheckpointError, match=r"holds 2 candidate params trees: state/ema/params, state/params; "
                                              r"choose one with params_path="):
        load_model(tmp_path / "ckpt", config_from=model.config)
    m = load_model(tmp_path / "ckpt", params_path="state/params", config_from=model.config)
    assert params_equal(m.params, saved[3])
    half = load_model(tmp_path / "ckpt", params_path="state/ema/params", config_from=model.config)
    np.testing.assert_allclose(np.asarray(half.params["norm"]["scale"]), 0.5 * saved[3]["norm"]["scale"])
    with pytest.raises(CheckpointError, match=r"params_path 'state/nope' not found in .*: state has keys "
                                              r"\['ema', 'opt_state', 'params'\]"):
        load_model(tmp_path / "ckpt", params_path="state/nope", config_from=model.config)


def test_a_tree_that_does_not_match_the_config_names_the_first_tensor(run):
    folder, cfg, _ = run
    wider = dataclasses.replace(cfg, intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"^params state/params of step 30 in .* do not match the model config "
                                              r"\(qwen3, 2 layers, hidden 48\): layers_0/mlp/down_proj/kernel: "
                                              r"expected float32\[64, 48\], got float32\[96, 48\] \(and 5 more\)$"):
        load_model(folder, config_from=wider)
    deeper = tiny_config("qwen3", num_layers=3)
    with pytest.raises(CheckpointError, match=r"missing layers_2/"):
        load_model(folder, config_from=deeper)


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # the full restore below, on purpose
def test_only_the_params_are_read(tmp_path):
    """Arrays stored one folder each (no OCDBT): delete the optimizer state's data chunks (their small metadata
    files stay), and the params still load, while restoring the whole item (what a loader that reads everything
    would do) fails."""
    model = random_model("qwen3", seed=9)
    saved = write_run(tmp_path / "ckpt", model, steps=(2,), handler=ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    state = tmp_path / "ckpt" / "2" / "state"
    chunks = [f for d in state.iterdir() if d.name.startswith("opt_state.") for f in d.rglob("*")
              if f.is_file() and f.name not in (".zarray", ".zattrs", "zarr.json")]
    assert len(chunks) > 10
    for f in chunks:
        f.unlink()
    with pytest.raises(Exception, match="error while reading array"):  # TensorStore: a missing chunk
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(state.absolute())
    m = load_model(tmp_path / "ckpt", config_from=model.config)
    assert params_equal(m.params, saved[2])


def test_restored_straight_into_a_mesh(run):
    folder, cfg, saved = run
    mesh = make_mesh({"data": 1, "model": len(jax.devices())})
    m = load_model(folder, step=10, mesh=mesh)
    assert isinstance(m, ShardedModel) and m.mesh is mesh
    assert all(isinstance(x.sharding, jax.sharding.NamedSharding) for x in jax.tree.leaves(m.params))
    np.testing.assert_allclose(m.logits(IDS), _logits(cfg, saved[10]), atol=1e-5)


def test_a_single_item_manager_holding_only_the_params(tmp_path):
    """`CheckpointManager` without item names saves one item, `default`: here the params tree itself."""
    model = random_model("qwen3", seed=3)
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager((tmp_path / "c").absolute(), options=opts) as mngr:
        mngr.save(7, args=ocp.args.StandardSave(model.params))
    m = load_model(tmp_path / "c", config_from=model.config)
    assert m.loaded_from["params_path"] == "default" and params_equal(m.params, model.params)


def test_model_folders_named_like_steps_stay_model_folders(tmp_path):
    models = {step: random_model("qwen3", seed=step) for step in (10, 20)}
    for step, model in models.items():  # exports per step: out/10/, out/20/
        save_model(model, tmp_path / str(step))
    m = load_model(tmp_path / "10")
    assert params_equal(m.params, models[10].params) and not hasattr(m, "loaded_from")


def test_subfolders_named_like_prefixed_steps_are_not_steps(tmp_path, run):
    """A manager names every step one way (Orbax is told its prefix); a subfolder named otherwise is not a step:
    not in a model folder (an export with `eval_1/` beside it stays a model folder), not beside plain-number steps
    (`eval_results_7/`), not Orbax's own `ocdbt.process_0` inside an item folder."""
    model = random_model("qwen3", seed=3)
    folder = save_model(model, tmp_path / "m")
    (folder / "eval_1").mkdir()
    (folder / "eval_1" / "scores.json").write_text("{}")
    assert params_equal(load_model(folder).params, model.params)
    copy = tmp_path / "run"
    shutil.copytree(run[0], copy)
    (copy / "ckpt" / "eval_results_7").mkdir()
    with pytest.raises(CheckpointError, match=rf"^step 7 not found in .*; steps: {STEPS[0]}, {STEPS[1]}$"):
        load_model(copy, step=7)
    assert load_model(copy).loaded_from["step"] == STEPS[1]
    item = copy / "ckpt" / str(STEPS[1]) / "state"
    (item / "ocdbt.process_0").mkdir(exist_ok=True)
    with pytest.raises(CheckpointError, match=r"is not a model folder: expected either a Hugging Face folder"):
        load_model(item)


def test_a_remote_run_without_its_storage_backend_is_one_line(monkeypatch, run):
    """gs:// paths go to etils.epath as they are (they were made local paths: "/cwd/gs:/bucket/run not found"); where
    its backend (gcsfs) is not installed, the error says so in one line, with and without a step."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # not installed (an optional install of etils' gs:// backend)
    for step in (None, 3):  # (etils names the backend it lacks: gcsfs, or tensorflow's gfile where that is installed)
        with pytest.raises(CheckpointError, match=r"^cannot read gs://bucket/run: "):
            load_model("gs://bucket/run", step=step)
    with pytest.raises(CheckpointError, match=r"^cannot read gs://bucket/run: "):
        resolve_step("gs://bucket/run")
    with pytest.raises(CheckpointError, match=r"^cannot read config_from gs://bucket/hf: "):
        load_model(run[0], config_from="gs://bucket/hf")


SHARDED_CHECK = """
import json, sys
import jax, numpy as np
import parse_jax as pj
run = sys.argv[1]
mesh = pj.make_mesh("data=2,model=2")
m = pj.load_model(run, step=10, mesh=mesh)
plain = pj.load_model(run, step=10)
q = m.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
ids = np.array([[5, 17, 3, 88, 41, 2, 9], [60, 1, 1, 33, 7, 70, 12]])
print(json.dumps({"devices": len(q.sharding.device_set), "shard": list(q.addressable_shards[0].data.shape),
                  "full": list(q.shape), "err": float(np.abs(m.logits(ids) - plain.logits(ids)).max())}))
"""


@pytest.mark.subprocess
def test_restored_shard_by_shard_on_four_devices(run):
    """On a 2 x 2 mesh of fake CPU devices (a subprocess: the device count is fixed when jax starts), each q_proj
    shard holds half the heads, and the logits equal the single-device load."""
    folder, _, _ = run
    out = run_on_devices(SHARDED_CHECK, str(folder))
    assert out["devices"] == 4 and out["full"] == [48, 128] and out["shard"] == [48, 64]
    assert out["err"] <= 1e-5


def test_step_arguments_on_a_plain_model_folder_are_an_error(tmp_path):
    path = save_model(random_model("qwen3", seed=2), tmp_path / "m")
    with pytest.raises(CheckpointError, match="is a model folder, not an Orbax CheckpointManager folder .*: drop step"):
        load_model(path, step=3)


def test_this_projects_training_runs_load_with_config_and_tokenizer(tmp_path):
    """A run of parse-jax's own trainer (RUN/run.json + RUN/ckpt/<step>/{state,meta}) loads with no other argument:
    config from run.json, the embedded task's tokenizer, the params its own restore gives."""
    from parse_jax.tasks import load_task
    from parse_jax.train.data import BatchStream, Encoder
    from parse_jax.train.pipeline import load_tokenizer, model_config
    from parse_jax.train.recipe import ModelSpec, PhaseSpec
    from parse_jax.train.trainer import PhaseOptions, restore_params, train_phase

    tok = load_tokenizer()
    cfg = model_config(ModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                 max_position_embeddings=64), tok)
    spec = dataclasses.replace(PhaseSpec(), steps=4, batch_size=4, warmup_steps=1, checkpoint_every=2, seed=1)
    stream = BatchStream(load_task(), Encoder(tok, load_task()), 44, spec.batch_size, spec.seed, judge=False)
    train_phase("draft", cfg, spec, stream.batch, tmp_path / "run", {}, PhaseOptions(progress=False))
    for step in (2, 4):
        m = load_model(tmp_path / "run", step=step)
        assert m.config == cfg and params_equal(m.params, restore_params(tmp_path / "run", cfg, spec, step))
    m = load_model(tmp_path / "run")
    assert m.loaded_from["step"] == 4 and m.tokenizer.encode("( 1 + 2 ) :") == tok.encode("( 1 + 2 ) :")
