"""Bad input through the Python API: each entry point refuses with a parse-jax error naming the field and
the value (never a truncated float, a silent clamp or a deep traceback), before any work or allocation."""

import math

import numpy as np
import pytest

import parse_jax as pj
from parse_jax.checkpoints.pair import PAIR_DIR
from parse_jax.distributed.mesh import parse_mesh_spec
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError, InputError, ParseJaxError
from parse_jax.harness.bench import run_bench
from parse_jax.harness.eval.evaluate import evaluate
from parse_jax.harness.runs import RunSettings, mode_runner
from parse_jax.harness.sweep import calibrate, run_sweep, sweep_configs
from parse_jax.runtime.decode import generate
from parse_jax.speculation.eagle3.formats import load_eagle3, save_eagle3
from parse_jax.tasks import load_task
from parse_jax.train.eagle3 import Eagle3Spec
from parse_jax.train.recipe import PhaseSpec
from parse_jax.utils.validation import SEED_MAX
from tests.test_engine import DRAFT, TARGET

TASK = load_task()
PROMPT = "( 1 + 2 ) :"


def _engine(**kw):
    return ParseEngine(TARGET, DRAFT, ParseConfig(**{"max_draft_tokens": 8, **kw}))


def _settings(**kw):
    return RunSettings(**{"n": 2, "max_new_tokens": 4, "batch_size": 2, "repeats": 1, "progress": False, **kw})


def _bench(**kw):
    return run_bench(_engine(), TASK, _settings(**kw), modes=["target"], log=lambda s: None)


def _sweep(**kw):
    return run_sweep(ParseEngine(TARGET, DRAFT, ParseConfig()), TASK, "threshold", ["0.5"], _settings(**kw))


def _calibrate(**kw):
    return calibrate(ParseEngine(TARGET, DRAFT, ParseConfig()), TASK, **kw)


def _eval(records=None, **kw):
    records = TASK.problems(2, 3) if records is None else records
    return evaluate(TARGET, DRAFT, records, **{"mode": "target", "max_new_tokens": 4, **kw})


# (call, error class, text the message must contain): entry points this side of the engine
CASES = [
    (lambda: _bench(n=0), InputError, "n must be >= 1, got 0"),
    (lambda: _bench(n=2.5), InputError, "n must be an integer, got 2.5"),
    (lambda: _bench(repeats=0), InputError, "repeats must be >= 1, got 0"),
    (lambda: _bench(batch_size=1.5), InputError, "batch_size must be an integer, got 1.5"),
    (lambda: _bench(max_new_tokens=0), InputError, "max_new_tokens must be >= 1, got 0"),
    (lambda: _bench(max_new_tokens=8.7), InputError, "max_new_tokens must be an integer, got 8.7"),
    (lambda: _bench(seed=-1), InputError, "seed must be >= 0, got -1"),
    (lambda: _bench(seed=2**70), InputError, f"seed must be <= {SEED_MAX}"),
    (lambda: _bench(seed=2**31), InputError, "seed must be <= 2147483647, got 2147483648"),  # one seed range
    # one stop-id check for pj.generate and the engine: a string is not read as its characters
    (lambda: generate(TARGET, [PROMPT], max_new_tokens=2, eos_ids="20"), InputError,
     "eos_ids must be a list of token ids, got '20'"),
    (lambda: generate(TARGET, [PROMPT], max_new_tokens=2, eos_ids=[999]), InputError, "eos_ids must be <= 26"),
    (lambda: generate(TARGET, [PROMPT], max_new_tokens=2, eos_ids=[-1]), InputError, "eos_ids must be >= 0"),
    (lambda: _engine().generate([PROMPT], max_new_tokens=2, eos_ids="20"), InputError,
     "eos_ids must be a list of token ids, got '20'"),
    (lambda: generate(TARGET, ["   "], max_new_tokens=2), InputError, "prompt 0 is empty or only whitespace"),
    (lambda: generate(TARGET, ["( 1 \udcff"], max_new_tokens=2), InputError, "prompt 0 is not valid UTF-8 text"),
    (lambda: generate(TARGET, ["\ud800 ( 1"], max_new_tokens=2), InputError,  # a surrogate no byte escaped
     "prompt 0 is not valid UTF-8 text (a byte that is not UTF-8 at character 0: '? ( 1')"),
    (lambda: TARGET.logits([[1, 5, 6], [1, 5]]), InputError, "logits expects rows of equal length"),
    (lambda: ParseEngine(TARGET, DRAFT, ParseConfig(suffix_format="chat")), ConfigError,
     "suffix_format='chat' writes the verification suffix with the target's chat template, and its tokenizer has none"),
    (lambda: _engine().boundaries([-1, 5]), InputError, "draft_ids: token ids outside [0, 27): [-1]"),
    (lambda: _engine().boundaries([5, 999]), InputError, "draft_ids: token ids outside [0, 27): [999]"),
    (lambda: _engine().boundaries("3 + 4 ;"), InputError, "draft_ids must be a list of token ids, got str"),
    (lambda: ParseEngine(TARGET, DRAFT, mesh="data=1"), ConfigError, "mesh must be a jax.sharding.Mesh"),
    (lambda: pj.load_model(PAIR_DIR / "target", mesh="data=1"), ConfigError,
     "mesh must be a jax.sharding.Mesh, e.g. pj.make_mesh({'data': 1}) or pj.make_mesh('data=2,model=4'), got str"),
    (lambda: pj.shard_model(TARGET, 4), ConfigError, "mesh must be a jax.sharding.Mesh"),
    # eval: each record is checked before the first runs, named by its line
    (lambda: _eval(records=[TASK.problems(1, 3)[0], {"question": "What is " + "1 + " * 300 + "1?",
                                                     "answer": "#### 301"}]), InputError,
     "1 record(s) cannot be run: line 2: the record has"),
    (lambda: _eval(max_new_tokens=100000), InputError, "line 1: the record has"),
    (lambda: _eval(mode="eagle3"), ConfigError, "mode 'eagle3' needs an EAGLE-3 head"),
    (lambda: _eval(records=[{"prompt": "x" * 1_000_000}]), InputError, "record 1: 'prompt' is not a problem"),
    (lambda: _bench(eos_ids=[10**6]), InputError, "eos_ids must be <="),
    (lambda: _bench(eos_ids="1,2"), InputError, "eos_ids must be a list of token ids"),
    (lambda: _sweep(n=0), InputError, "n must be >= 1, got 0"),
    (lambda: _sweep(repeats=2.5), InputError, "repeats must be an integer, got 2.5"),
    (lambda: sweep_configs(ParseConfig(), "threshold", ["0.5", "1.5"]), InputError, "threshold must lie in [0, 1]"),
    (lambda: sweep_configs(ParseConfig(), "max_prefixes", ["2.5"]), InputError, "must be numbers, got '2.5'"),
    (lambda: _calibrate(tolerance=1.5), InputError, "tolerance must lie in [0, 1)"),
    (lambda: _calibrate(tolerance=math.nan), InputError, "tolerance must be a finite number"),
    (lambda: _calibrate(thresholds=[0.5, 7.0]), ConfigError,
     "threshold must lie in [0, 1], got 7"),
    (lambda: _eval(batch_size=0), InputError, "batch_size must be >= 1, got 0"),
    (lambda: _eval(max_new_tokens=2.5), InputError, "max_new_tokens must be an integer, got 2.5"),
    (lambda: _eval(temperature=math.nan), InputError, "temperature must be a finite number"),
    (lambda: _eval(temperature=-1.0), InputError, "temperature must lie in [0, inf), got -1"),
    (lambda: _eval(seed=2**70), InputError, "seed must be <="),
    (lambda: _eval(eos_ids=[-3]), InputError, "eos_ids must be >= 0, got -3"),
    (lambda: evaluate(TARGET, DRAFT, None, mode="target"), InputError, "records must be a JSONL path or a list"),
    (lambda: mode_runner(TARGET, None, None, "parse"), ConfigError, "needs a draft model"),
    (lambda: parse_mesh_spec("data=1,data=1"), ConfigError, "axis 'data' given twice"),
    (lambda: parse_mesh_spec({"data": 2.5}), ConfigError, "mesh axis data must be an integer, got 2.5"),
    (lambda: parse_mesh_spec({"data": True}), ConfigError, "mesh axis data must be an integer, got True"),
    (lambda: parse_mesh_spec({"data": 0}), ConfigError, "mesh axis data must be >= 1"),
    (lambda: Eagle3Spec(lr=math.nan), ConfigError, "lr must be a finite number, got nan"),
    (lambda: Eagle3Spec(lr=math.inf), ConfigError, "lr must be a finite number, got inf"),
    (lambda: Eagle3Spec(lr=0.0), ConfigError, "lr must lie in (0, inf), got 0"),
    (lambda: Eagle3Spec(steps=2.5), ConfigError, "steps must be an integer, got 2.5"),
    (lambda: PhaseSpec(lr=math.nan), ConfigError, "training: lr must be a finite number"),
    (lambda: PhaseSpec(lr=-1e-3), ConfigError, "training: lr must lie in (0, inf)"),
    (lambda: PhaseSpec(batch_size=7.9), ConfigError, "training: batch_size must be an integer, got 7.9"),
    (lambda: generate(None, [PROMPT], max_new_tokens=2), InputError, "model must be a model (pj.load_model"),
    (lambda: generate(TARGET, [PROMPT], max_new_tokens=2, max_cache_len=40.5), InputError,
     "max_cache_len must be an integer, got 40.5"),
    # a boundary is a token position: never cut from a fraction, and a list of them
    (lambda: _engine().prefix_scores([1, 17], [5, 14, 6, 18], [1.5, 4]), InputError,
     "boundary 0 must be an integer, got 1.5"),
    (lambda: _engine().prefix_scores([1, 17], [5, 14, 6, 18], None), InputError,
     "boundaries must be a list of token positions (ints), got None"),
    (lambda: _engine().prefix_scores([1, 17], [5, 14, 6, 18], 4), InputError,
     "boundaries must be a list of token positions (ints), got 4"),
    # the config is checked in every mode, the target's (which runs no engine) included
    (lambda: _eval(config={"threshold": 2}), ConfigError, "config must be a pj.ParseConfig, got dict"),
    (lambda: load_eagle3(None), InputError, "path must be a path (a non-empty str or os.PathLike), got None"),
    # the token-speculation entry points check what pj.generate and the engine check
    (lambda: pj.speculative_generate(TARGET, DRAFT, [PROMPT], max_new_tokens=2, eos_ids="61"), InputError,
     "eos_ids must be a list of token ids, got '61'"),
    (lambda: pj.speculative_generate(TARGET, DRAFT, [PROMPT], max_new_tokens=2, eos_ids=[999]), InputError,
     "eos_ids must be <= 26"),
    (lambda: pj.eagle3_generate(*_pair_target_and_head(), [PROMPT], max_new_tokens=2, eos_ids=[1.7]),
     InputError, "eos_ids must be an integer, got 1.7"),
    (lambda: pj.speculative_generate(TARGET, DRAFT, [PROMPT], max_new_tokens=2, gamma=2.5), InputError,
     "gamma must be an integer, got 2.5"),
    (lambda: pj.speculative_generate(TARGET, DRAFT, [PROMPT], max_new_tokens=2, gamma="3"), InputError,
     "gamma must be an integer, got '3'"),
    (lambda: pj.speculative_generate(TARGET, DRAFT, [PROMPT], max_new_tokens=2, gamma=1000), InputError,
     "gamma must be <= 64, got 1000"),
    (lambda: pj.speculative_generate(TARGET, None, [PROMPT], max_new_tokens=2), InputError,
     "draft must be a model (pj.load_model"),
    (lambda: pj.speculative_generate(TARGET, DRAFT, [PROMPT], max_new_tokens=2, max_cache_len="64"), InputError,
     "max_cache_len must be an integer, got '64'"),
    (lambda: pj.eagle3_generate(*_pair_target_and_head(), [PROMPT], max_new_tokens=2, tree=2.5), InputError,
     "tree must be an integer, got 2.5"),
    (lambda: pj.eagle3_generate(*_pair_target_and_head(), [PROMPT], max_new_tokens=2, gamma=None),
     InputError, "gamma must be an integer, got None"),
    (lambda: pj.export_speculators(*reversed(_pair_target_and_head()), "/nonexistent/head", speculative_tokens=2.5),
     InputError, "speculative_tokens must be an integer, got 2.5"),
    (lambda: generate(TARGET, [PROMPT], max_new_tokens=2, add_bos="yes"), InputError,
     "add_bos must be True or False, got 'yes'"),
    # params that do not fit the config: one line here, not flax's error from inside the first program
    (lambda: pj.Model(TARGET.config, {**TARGET.params, "embed_tokens": {"embedding": np.zeros((27, 1), np.float32)}}),
     ConfigError, "embed_tokens/embedding: expected float32[27, 48], got float32[27, 1]"),
]


@pytest.mark.parametrize("call, error, message", CASES, ids=[c[2][:40] for c in CASES])
def test_api_bad_input_names_the_field_and_value(call, error, message):
    with pytest.raises(error) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)
    assert len(str(e.value)) < 1000  # a huge value is cut, never echoed whole


def test_train_out_as_a_file_is_refused(tmp_path):
    from parse_jax.train.eagle3 import train_eagle3
    from parse_jax.train.pipeline import run_recipe
    from parse_jax.train.recipe import Recipe

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        run_recipe(Recipe(), out=blocker)
    with pytest.raises(ConfigError, match="is a file"):
        train_eagle3(TARGET, TASK, blocker, Eagle3Spec(steps=1, samples=1))
    assert blocker.read_text() == "x"


def test_a_prompt_the_tokenizer_cannot_write_is_said_once(parse_jax_warnings, monkeypatch):
    """Text outside a word-level vocabulary encodes to the unknown token, as transformers encodes it: the model
    then answers another prompt, so a warning names the prompt (once per tokenizer and process: an eval checks its
    records one by one); text it can write says nothing."""
    import copy
    import types
    import weakref

    from parse_jax.runtime import requests

    monkeypatch.setattr(requests, "_WARNED_UNWRITABLE", weakref.WeakSet())
    requests.encode_prompts(TARGET, [PROMPT])
    assert parse_jax_warnings == []
    requests.encode_prompts(TARGET, [PROMPT, "( 12 + 3 ) :", "2+3="])
    requests.encode_prompts(TARGET, ["2+3="])
    assert len(parse_jax_warnings) == 1
    assert parse_jax_warnings[0].startswith("prompt text this tokenizer's vocabulary cannot write")
    assert "(first seen: '( 12 + 3 ) :', at token 1 of its text)" in parse_jax_warnings[0]
    other = types.SimpleNamespace(tokenizer=copy.copy(TARGET.tokenizer), config=TARGET.config)
    requests.encode_prompts(other, ["2+3="])  # another tokenizer: said for it too
    assert len(parse_jax_warnings) == 2


def test_saving_something_else_as_a_head_is_refused_and_writes_nothing(tmp_path):
    with pytest.raises(ConfigError, match="head must be an EAGLE-3 head .* got NoneType"):
        save_eagle3(None, tmp_path / "head")
    assert list(tmp_path.iterdir()) == []


def test_a_head_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """The head's folder appears under its name only once its config and params are both written."""
    import orbax.checkpoint as ocp

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    head = TARGET.eagle3 if getattr(TARGET, "eagle3", None) is not None else load_eagle3_of_pair()
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail)
    with pytest.raises(ParseJaxError, match="No space left on device"):
        save_eagle3(head, tmp_path / "head")
    assert list(tmp_path.iterdir()) == []


def _pair_target_and_head():
    target = pj.load_pair()[0]
    return target, target.eagle3


def load_eagle3_of_pair():
    from parse_jax.checkpoints.pair import load_pair

    return load_pair()[0].eagle3


# Engine-level cases (parse_jax/engine.py, runtime/decode.py, verify/): the engine's own validation.
ENGINE_CASES = [
    (lambda: ParseConfig(threshold=-1), "threshold"),
    (lambda: ParseConfig(threshold=5.0), "threshold"),
    (lambda: ParseConfig(threshold="0.5"), "threshold"),
    (lambda: ParseConfig(max_prefixes=2.5), "max_prefixes"),
    (lambda: ParseEngine(TARGET, None).generate([PROMPT], mode="parse", max_new_tokens=4), "draft"),
    (lambda: ParseEngine(TARGET, DRAFT, ParseConfig(judge_yes="Yes")), "Yes"),
    (lambda: _engine().generate([1, 2, 3], max_new_tokens=4), "prompt"),
    (lambda: _engine().generate(None, max_new_tokens=4), "prompt"),
    (lambda: _engine().generate([PROMPT], mode="parse", max_new_tokens=100000), "100000"),
    (lambda: _engine().prefix_scores(list(np.arange(5000) % 20 + 4), [5, 6, 7], [3]), "5000"),
    (lambda: _engine().generate([PROMPT], max_new_tokens=4, seed=2**70), "seed"),
]


@pytest.mark.parametrize("call, field", ENGINE_CASES, ids=[str(i) for i in range(len(ENGINE_CASES))])
def test_engine_bad_input_is_refused_with_a_named_field(call, field):
    with pytest.raises(ParseJaxError) as e:
        call()
    assert field in str(e.value)


def test_eos_ids_reach_the_engine():
    """--eos-ids / eos_ids=...: generation stops at the first id given (needs ParseEngine.generate(eos_ids=))."""
    cfg = ParseConfig(max_draft_tokens=8)
    for mode in ("target", "parse"):
        full = mode_runner(TARGET, DRAFT, cfg, mode)([PROMPT], 8, 0)
        ids = [int(t) for t in full.tokens[0]]
        k = ids.index(ids[2])  # where that id first appears
        res = mode_runner(TARGET, DRAFT, cfg, mode, eos_ids=[ids[2]])([PROMPT], 8, 0)
        assert [int(t) for t in res.tokens[0]] in (ids[:k], ids[:k + 1]), mode  # the stop id kept or dropped


def test_eval_seeds_stay_in_the_one_range():
    """Per-batch seeds are seed + first line modulo 2**31: the top seed runs (it failed on seed + 1 before), and a
    seed below the top draws what it drew before the wrap existed."""
    from parse_jax.harness.eval.results import batch_seed

    assert batch_seed(SEED_MAX, 1) == 0 and batch_seed(5, 3) == 8
    res = _eval(seed=SEED_MAX, temperature=0.7)
    assert res.n == 2


def test_train_eagle3_resume_without_a_checkpoint_fails_before_the_teacher_pass(tmp_path):
    from parse_jax.errors import CheckpointError
    from parse_jax.train.eagle3 import train_eagle3

    out = tmp_path / "run"
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train_eagle3(TARGET, TASK, out, Eagle3Spec(steps=1, samples=2), mode="resume", progress=False)
    assert not out.exists()  # no samples.json: the teacher pass never ran


def test_boundaries_as_numpy_or_jax_arrays_are_token_positions():
    import jax.numpy as jnp

    from parse_jax.utils.validation import check_boundaries

    assert check_boundaries(np.array([2, 4]), 4) == check_boundaries(jnp.array([2, 4]), 4) == [2, 4]
    assert check_boundaries((x for x in (1, 3.0)), 4) == [1, 3]  # a generator, read once; 3.0 is 3
    with pytest.raises(InputError, match="boundary 0 must be an integer, got 2.5"):
        check_boundaries(jnp.array([2.5, 3.0]), 4)
    with pytest.raises(InputError, match="boundaries must be a list of token positions"):
        check_boundaries(jnp.array(2), 4)
