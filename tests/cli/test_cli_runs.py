"""`parse-jax generate / bench` on steps of training runs (`--target RUN_DIR --step N --draft RUN_DIR`), through
`main()` in this process (the console script's code path); `eval` is covered in tests/harness/eval/test_evaluate.py."""

import json

import pytest

from parse_jax import load_model
from parse_jax.checkpoints.pair import PAIR_DIR as PAIR
from parse_jax.cli import main
from parse_jax.engine import ParseConfig, ParseEngine
from tests.checkpoints.runs_fixture import write_run

PROMPT = "( 1 + 2 ) * ( 3 - 4 ) :"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs laid out as this project's trainer does (RUN/run.json + RUN/ckpt/<step>/{state,meta})."""
    from tests.test_engine import DRAFT, TARGET

    root = tmp_path_factory.mktemp("runs")
    write_run(root / "target_run", TARGET, steps=(4, 10), run_json=True)
    write_run(root / "draft_run", DRAFT, steps=(30,), run_json=True)
    return root / "target_run", root / "draft_run"


def _main(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_on_a_step_of_a_run_prints_what_that_step_writes(runs, capsys):
    target_run, draft_run = runs
    draft = load_model(draft_run)
    texts = {}
    for step in (4, 10):
        rc, out, err = _main(capsys, "generate", "--target", str(target_run), "--step", str(step), "--draft",
                             str(draft_run), "--mode", "parse", "--max-new-tokens", "12", "--max-draft-tokens", "12",
                             "--schedule", "fixed", PROMPT)
        assert rc == 0, err
        eng = ParseEngine(load_model(target_run, step=step), draft, ParseConfig(max_draft_tokens=12, schedule="fixed"))
        texts[step] = eng.generate([PROMPT], mode="parse", max_new_tokens=12).texts[0]
        assert texts[step] in out
    assert texts[4] != texts[10]  # so the step given is the step used


def test_bench_records_the_steps_it_ran(runs, tmp_path, capsys):
    target_run, draft_run = runs
    out = tmp_path / "bench.json"
    rc, _, err = _main(capsys, "bench", "--target", str(target_run), "--step", "4", "--draft", str(draft_run),
                       "--draft-step", "30", "--n", "2", "--modes", "target,parse", "--repeats", "1",
                       "--batch-size", "2", "--max-new-tokens", "8", "--json", str(out), "--no-progress")
    assert rc == 0, err
    models = json.loads(out.read_text())["provenance"]["config"]["models"]
    assert models["target_step"] == 4 and models["draft_step"] == 30
    assert models["target"] == str(target_run.resolve())


def test_run_flag_errors_are_one_line_messages(runs, capsys, tmp_path):
    from parse_jax.harness.eval.data import write_task_jsonl
    from parse_jax.tasks import load_task

    target_run, draft_run = runs
    data = write_task_jsonl(load_task(), 1, tmp_path / "p.jsonl", seed=1)
    cases = [
        (["generate", "--step", "3", PROMPT], "--step: only with --target RUN_DIR"),
        (["generate", "--target", str(target_run), "--draft-step", "3", PROMPT], "--draft-step: only with --draft"),
        (["generate", "--target", str(target_run), "--step", "15", "--mode", "target", PROMPT],
         "--step 15: step 15 not found in " + str(target_run / "ckpt") + "; steps: 4, 10"),
        (["generate", "--target", str(target_run), "--draft", str(draft_run), "--draft-step", "998", PROMPT],
         "--draft-step 998: step 998 not found in "),
        (["eval", "--target", str(target_run), "--draft", str(draft_run), "--draft-step", "998", "--data",
          str(data), "--out", str(tmp_path / "r.jsonl")],
         "--draft-step 998: step 998 not found in "),
        (["generate", "--target", str(target_run), "--draft", str(draft_run), "--draft-params-path", "state/x",
          PROMPT], "--draft-params-path 'state/x' not found"),
        (["generate", "--target", str(target_run), "--params-path", "state/x", PROMPT],
         "--params-path 'state/x' not found"),
        (["generate", "--target", str(target_run), "--draft", str(PAIR / "draft"), "--draft-step", "3", PROMPT],
         "not an Orbax CheckpointManager folder (step subfolders): drop --draft-step"),
        (["generate", "--target", str(PAIR / "target"), "--step", "3", "--params-path", "x", "--mode", "target",
          PROMPT], "not an Orbax CheckpointManager folder (step subfolders): drop --step, --params-path"),
    ]
    for args, message in cases:
        rc, _, err = _main(capsys, *args)
        assert rc == 2 and message in err and "Traceback" not in err, (args, err)
        assert err.strip().count("\n") == 0 or all("loading" in x for x in err.strip().splitlines()[:-1]), err


def test_the_latest_step_is_pinned_before_loading(runs, tmp_path):
    """Without --step the latest finished step is chosen once: a step the run saves afterwards changes neither the
    step loaded nor the step recorded (an eval results file's header is written before the models load)."""
    import argparse
    import shutil

    from parse_jax.cli.setup import model_desc, pin_steps

    target_run, draft_run = runs
    run = tmp_path / "run"
    shutil.copytree(target_run, run)
    args = argparse.Namespace(pair=None, model=str(run), draft=str(draft_run), dtype=None, step=None,
                              params_path=None, config_from=None, draft_step=None, draft_params_path=None,
                              draft_config_from=None)
    pin_steps(args)
    assert (args.step, args.draft_step) == (10, 30)
    shutil.copytree(run / "ckpt" / "10", run / "ckpt" / "20")  # training goes on and saves step 20
    assert model_desc(args)["target_step"] == 10 and args.step == 10
