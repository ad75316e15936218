"""`parse-jax generate` and `parse-jax convert` as a user runs them: the console script, in a subprocess."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from parse_jax import generate, load_model
from tests.models.hf_tiny import make_tiny_hf


def _cli(*args):
    exe = shutil.which("parse-jax")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "parse_jax.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf("qwen3", tmp_path_factory.mktemp("hf"), seed=3)


@pytest.mark.subprocess
def test_convert_then_generate_prints_the_models_text(hf_dir, tmp_path):
    out = tmp_path / "orbax"
    r = _cli("convert", "--hf", str(hf_dir), "--out", str(out))
    assert r.returncode == 0, r.stderr
    again = _cli("convert", "--hf", str(hf_dir), "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr
    assert _cli("convert", "--hf", str(hf_dir), "--out", str(out), "--overwrite").returncode == 0

    model = load_model(out)
    prompt = model.tokenizer.decode(np.random.default_rng(0).integers(4, model.config.vocab_size, 6).tolist())
    expect = generate(model, [prompt], max_new_tokens=8).texts[0]
    r = _cli("generate", "--model", str(out), prompt, "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expect


@pytest.mark.subprocess
def test_cli_errors_are_one_line_messages(tmp_path, hf_dir):
    r = _cli("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert r.returncode == 2 and "nowhere" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--model", str(hf_dir), "")
    assert r.returncode == 2 and "empty" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.subprocess
def test_generate_modes_on_a_pair_print_what_the_engine_writes(pair_dir):
    from parse_jax import ParseConfig, ParseEngine, load_pair

    target, draft = load_pair(pair_dir)
    prompt = "( 3 + 4 ) * ( 5 - 2 ) :"
    eng = ParseEngine(target, draft, ParseConfig(threshold=0.3))
    for mode in ("target", "sd", "parse"):
        expect = eng.generate([prompt], mode=mode, max_new_tokens=12).texts[0]
        r = _cli("generate", "--pair", str(pair_dir), "--mode", mode, "--threshold", "0.3", "--max-new-tokens", "12",
                 prompt)
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip("\n") == expect


@pytest.mark.subprocess
def test_bench_writes_the_design_schema(pair_dir, tmp_path):
    out = tmp_path / "res" / "bench.json"
    r = _cli("bench", "--pair", str(pair_dir), "--n", "4", "--modes", "target,parse,sd", "--max-new-tokens", "8",
             "--batch-size", "2", "--repeats", "1", "--json", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "| parse |" in r.stdout

    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"target", "parse", "sd"}
    for row in res["modes"].values():
        assert {"tokens_per_s", "accuracy", "speedup_vs_target", "accepted_per_pass"} <= set(row)
    assert res["command"].startswith("parse-jax bench") and res["n"] == 4


@pytest.mark.subprocess
def test_pair_and_mode_errors_are_one_line_messages(pair_dir, tmp_path, hf_dir):
    r = _cli("bench", "--pair", str(tmp_path), "--n", "2")
    assert r.returncode == 2 and "not a pair folder" in r.stderr and "Traceback" not in r.stderr
    r = _cli("bench", "--pair", str(pair_dir), "--modes", "target,warp")
    assert r.returncode == 2 and "warp" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--pair", str(pair_dir), "--mode", "warp", "1 :")
    assert r.returncode == 2 and "unknown mode" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--model", str(hf_dir), "--mode", "parse", "hi")
    assert r.returncode == 2 and "--draft" in r.stderr and "Traceback" not in r.stderr
    r = _cli("bench", "--pair", str(pair_dir), "--n", "2", "--json", "/proc/nope/bench.json")
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr


# --- bench --out, sweep, calibrate, eval: through `main()` in this process (the console script's code path, without
# paying a jax import per call)

def _main(capsys, *args):
    from parse_jax.cli import main

    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_bench_out_writes_every_file(pair_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    rc, stdout, err = _main(capsys, "bench", "--pair", str(pair_dir), "--n", "5", "--modes", "target",
                            "--max-new-tokens", "10", "--batch-size", "5", "--repeats", "2", "--out", str(out),
                            "--no-progress")
    assert rc == 0, err
    assert {p.name for p in out.iterdir()} == {"bench.json", "bench.md", "bench_throughput.png", "bench_accuracy.png"}

    res = json.loads((out / "bench.json").read_text())
    assert res["command"].startswith("parse-jax bench") and res["provenance"]["config"]["models"]["pair"]
    assert res["repeats"] == 2 and len(res["modes"]["target"]["tokens_per_s_all"]) == 2
    assert "| target |" in (out / "bench.md").read_text() and "| target |" in stdout


def test_calibrate_writes_its_settings_with_the_threshold_it_chose(pair_dir, tmp_path, capsys):
    """The calibrated settings are a --parse-config file: the chosen threshold, and the other settings as given."""
    from parse_jax.settings import ParseConfig

    out = tmp_path / "cal"
    rc, stdout, err = _main(capsys, "calibrate", "--pair", str(pair_dir), "--n", "4", "--thresholds", "0.3,0.99",
                            "--max-new-tokens", "10", "--batch-size", "4", "--repeats", "1", "--set",
                            "prefix_choice=auto", "--out", str(out), "--no-progress")
    assert rc == 0, err
    chosen = float(stdout.split("threshold: ")[1].split()[0])
    cfg = ParseConfig.load(out / "parse_config.yaml")
    assert cfg.threshold == chosen and cfg.prefix_choice == "auto"
    assert f"--parse-config {out / 'parse_config.yaml'}" in stdout
    head = (out / "parse_config.yaml").read_text().splitlines()[:3]  # how the threshold was chosen
    assert head[1] == (f"# threshold {chosen:g}: chosen by parse-jax calibrate on 4 dev problems with mode parse "
                       "(single round, schedule fixed, batch 4);")
    assert head[2] == "# the other settings are as given (schedule auto, rounds auto)"


def test_a_calibration_that_finds_no_threshold_leaves_no_earlier_settings_behind(tmp_path, capsys):
    """Exit 1 when no threshold keeps accuracy (the embedded pair at threshold 0 keeps every draft: the draft's
    87.5% on these 16 dev problems against the target's 100%); the folder's parse_config.yaml of an earlier
    calibration is removed, never left for `--parse-config DIR/parse_config.yaml` to pick up."""
    out = tmp_path / "cal"
    out.mkdir()
    (out / "parse_config.yaml").write_text("threshold: 0.2\n")  # an earlier run's, into the same folder
    rc, stdout, err = _main(capsys, "calibrate", "--n", "16", "--thresholds", "0",
                            "--tolerance", "0", "--max-new-tokens", "32", "--out", str(out), "--no-progress")
    assert rc == 1, err
    assert "no threshold keeps accuracy within 0 points of the target's 100.0%" in stdout
    assert not (out / "parse_config.yaml").exists() and f"removed {out / 'parse_config.yaml'}" in stdout
    assert json.loads((out / "calibrate.json").read_text())["calibration"]["threshold"] is None
    # a settings file the run was given is its input, never removed
    (out / "parse_config.yaml").write_text("threshold: 0.2\n")
    rc, stdout, err = _main(capsys, "calibrate", "--n", "16", "--thresholds", "0", "--tolerance", "0",
                            "--max-new-tokens", "32", "--parse-config", str(out / "parse_config.yaml"), "--out",
                            str(out), "--no-progress")
    assert rc == 1 and (out / "parse_config.yaml").read_text() == "threshold: 0.2\n" and "removed" not in stdout


def test_new_commands_fail_early_with_one_line(pair_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = [
        (["bench", "--pair", str(pair_dir), "--n", "2", "--out", str(blocker / "d")], "cannot write to output folder"),
        (["bench", "--pair", str(pair_dir), "--rounds", "multi"], "parse-multi"),
        (["sweep", "--pair", str(pair_dir), "--param", "threshold", "--values", "0.1,x", "--out", str(tmp_path)],
         "must be numbers"),
        (["sweep", "--pair", str(pair_dir), "--param", "max_prefixes", "--values", "0", "--out", str(tmp_path)],
         "max_prefixes must be >= 1"),
        (["calibrate", "--pair", str(pair_dir), "--thresholds", "a", "--out", str(tmp_path)], "--thresholds"),
        # a mode no PARSE setting changes, refused before the models load (this pair folder does not exist)
        (["sweep", "--pair", str(tmp_path / "none"), "--param", "threshold", "--values", "0.5", "--mode", "sd",
          "--out", str(tmp_path)], "--mode 'sd': sweep and calibrate vary a PARSE setting"),
        (["calibrate", "--pair", str(tmp_path / "none"), "--mode", "eagle3", "--out", str(tmp_path)],
         "allowed: sequential, parse, parse-multi, parse+eagle3, parse+eagle3-multi"),
        (["calibrate", "--pair", str(pair_dir), "--out", str(blocker / "d")], "cannot write to output folder"),
        (["eval", "--data", str(tmp_path / "none.jsonl"), "--pair", str(pair_dir), "--out", str(tmp_path / "r.jsonl")],
         "cannot read data file"),
        (["eval", "--data", str(blocker), "--pair", str(pair_dir), "--mode", "warp", "--out", str(tmp_path / "r")],
         "unknown mode"),
    ]
    for args, message in cases:
        rc, _, err = _main(capsys, *args)
        assert rc == 2 and message in err and "Traceback" not in err, (args, err)
        assert err.count("\n") == 1, err


def test_eval_cli_bad_lines_resume_and_summary(pair_dir, tmp_path, capsys):

    from parse_jax.tasks import load_task

    probs = load_task().problems(3, 11)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([json.dumps({"prompt": probs[0][0]}), "{broken", json.dumps({"prompt": probs[1][0]}),
                               json.dumps({"prompt": probs[2][0], "solution": probs[2][1]})]) + "\n")
    out = tmp_path / "res" / "results.jsonl"
    args = ["eval", "--data", str(data), "--pair", str(pair_dir), "--mode", "target", "--max-new-tokens", "6",
            "--batch-size", "3", "--out", str(out), "--no-progress"]
    rc, _, err = _main(capsys, *args)
    assert rc == 2 and "line 2: not valid JSON" in err and not out.exists()
    rc, stdout, err = _main(capsys, *args, "--on-bad-line", "skip")
    assert rc == 0, err
    assert "skipping bad line 2" in err and "accuracy" in stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and [json.loads(x)["line"] for x in lines[1:]] == [1, 3, 4]
    summary = json.loads((tmp_path / "res" / "results.summary.json").read_text())
    assert summary["n"] == 3 and summary["bad_lines"][0]["line"] == 2
    assert summary["provenance"]["git_commit"] and summary["provenance"]["config"]["mode"] == "target"
    rc, stdout, _ = _main(capsys, *args, "--on-bad-line", "skip")
    assert rc == 0 and "3 of 3 records already done" in stdout and len(out.read_text().splitlines()) == 4
    rc, _, err = _main(capsys, *[a if a != "6" else "7" for a in args], "--on-bad-line", "skip")
    assert rc == 2 and "max_new_tokens: 6 then, 7 now" in err


# --- CLI habits: --version, defaults in --help, a parser built without jax, JSON output, -q

@pytest.mark.subprocess
def test_version_is_the_installed_one():
    from importlib.metadata import version

    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"parse-jax {version('parse-jax')}"


@pytest.mark.subprocess
def test_help_is_built_without_jax_and_shows_defaults():
    code = """
import sys
from parse_jax.cli import build_parser
parser = build_parser()
parser.format_help()
sub = next(a for a in parser._actions if a.dest == "command")
for name, command in sub.choices.items():
    text = command.format_help()
    formatter = command._get_formatter()
    for action in command._actions:
        shown = action.nargs != 0 and action.default not in (None, "==SUPPRESS==")
        if shown:
            assert "default" in formatter._expand_help(action), (name, action.dest)
    assert "--no-compile-cache" in text and "-q, --quiet" in text, name
print("jax imported:", "jax" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "jax imported: False"
    help_text = " ".join(_cli("bench", "--help").stdout.split())  # unwrapped
    assert "(default: 32)" in help_text and "(default: 0.5)" in help_text  # --max-new-tokens, --threshold


@pytest.mark.subprocess
def test_parse_defaults_in_help_are_the_engines():
    from parse_jax.cli.parser import PARSE_FLAGS
    from parse_jax.engine import ParseConfig

    fields = ParseConfig.flat_fields()  # the flat names the CLI and config files use
    help_text = " ".join(_cli("generate", "--help").stdout.split())
    for key in PARSE_FLAGS:
        assert f"(default: {fields[key]})" in help_text.split(f"--{key.replace('_', '-')} ")[-1].split(" --")[0]


def test_generate_json_round_trip_and_stats_as_json(pair_dir, capsys):

    from parse_jax import ParseConfig, ParseEngine, load_pair

    prompts = ["( 3 + 4 ) * ( 5 - 2 ) :", "( 7 - 1 ) :"]
    target, draft = load_pair(pair_dir)
    eng = ParseEngine(target, draft, ParseConfig(threshold=0.3, schedule="fixed"))
    expect = eng.generate(prompts, mode="parse", max_new_tokens=9)
    rc, out, err = _main(capsys, "generate", "--pair", str(pair_dir), "--mode", "parse", "--threshold", "0.3",
                         "--schedule", "fixed", "--max-new-tokens", "9", "--json", "--stats", *prompts)
    assert rc == 0, err
    objects = [json.loads(line) for line in out.splitlines()]
    assert [o["prompt"] for o in objects] == prompts
    assert [o["text"] for o in objects] == expect.texts
    assert [o["tokens"] for o in objects] == [[int(t) for t in ts] for ts in expect.tokens]
    for o, ids in zip(objects, expect.tokens, strict=True):
        assert target.tokenizer.decode(o["tokens"]) == o["text"]
        assert o["stats"]["target_passes"] == expect.stats["target_passes"]  # the call's, in each
        assert o["new_tokens"] == len(ids)
    stats = json.loads(err.strip().splitlines()[-1])  # --stats: one JSON object on stderr, not a Python repr
    assert stats["verify_passes"] == expect.stats["verify_passes"]


def test_quiet_keeps_stderr_for_warnings_and_results_on_stdout(pair_dir, capsys):
    args = ["generate", "--pair", str(pair_dir), "--mode", "target", "--max-new-tokens", "4", "1 :"]
    rc, out, err = _main(capsys, *args)
    assert rc == 0 and "loading the pair" in err and "loading" not in out
    rc, quiet_out, quiet_err = _main(capsys, *args, "-q")
    assert rc == 0 and quiet_err == "" and quiet_out == out


def test_the_commands_that_take_no_mesh_are_the_ones_the_docs_name():
    """docs/cli.md says which commands take --mesh: every one that loads models, except those it names."""
    from pathlib import Path

    from parse_jax.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    no_mesh = {name for name, p in sub.choices.items() if "--mesh" not in p._option_string_actions}
    assert {"convert", "export"} <= no_mesh <= {"convert", "export", "train"}  # train loads no model
    assert "no --mesh" in sub.choices["export"].format_help()
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    start = text.index("# every command that loads models also takes --mesh")
    said = text[start: text.index("\n", text.index("except", start))]
    for name in no_mesh - {"train"}:
        assert f" {name}" in said.split("except", 1)[1], (name, said)
