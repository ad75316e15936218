"""Bad input on the command line: every case exits 2 with exactly one line on stderr naming the problem
(the flag or field and the value), and every file present before the run is byte-identical after it (no
placeholder over an old result, no header-only results file, no empty output folder, no temporary left).

Through `main()` in this process (the console script's code path, without a jax import per case). Cases marked
`quiet` fail only once the models are loaded, so they run with -q (the "loading ..." phase lines are not errors).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from parse_jax.cli import main
from parse_jax.utils.validation import SEED_MAX

MODEL_ERRORS = ("cannot", "not found", "no such", "does not exist", "missing", "not a")


@pytest.fixture(scope="module")
def work(tmp_path_factory, pair_dir):
    """A folder of finished results (a bench JSON, a bench --out folder, a sweep folder, an eval results file with
    its summary) and of bad inputs (YAML files, data files, a plain file where a folder belongs)."""
    from parse_jax.tasks import load_task

    d = tmp_path_factory.mktemp("bad_input")
    (d / "good.json").write_text('{"modes": {"target": {"tokens_per_s": 1.0}}, "n": 300}\n')
    (d / "bench").mkdir()
    (d / "bench" / "bench.json").write_text('{"n": 1}\n')
    (d / "bench" / "bench.md").write_text("# old bench\n")
    (d / "sweep").mkdir()
    (d / "sweep" / "sweep_threshold.json").write_text('{"old": true}\n')
    probs = load_task().problems(2, 5)
    (d / "data.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in probs))
    (d / "gsm.jsonl").write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    header = {"type": "header", "version": 1, "data": str(d / "data.jsonl"), "data_sha256": "0" * 64,
              "settings": {"mode": "target"}}
    (d / "results.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(
        {"type": "result", "key": "1:abc", "line": 1, "correct": True}) + "\n")
    (d / "results.summary.json").write_text('{"n": 1}\n')
    (d / "file").write_text("a plain file\n")
    (d / "mesh_bad.yaml").write_text("mesh: {data: 2, model: [\n")
    (d / "pc_list.yaml").write_text("- threshold\n- 0.5\n")
    (d / "pc_typo.yaml").write_text("treshold: 0.3\n")
    (d / "pc_yes.yaml").write_text("judge_yes: Yes\n")  # YAML 1.1: a boolean, not the word
    (d / "pc_float.yaml").write_text("max_prefixes: 2.5\n")
    (d / "pc_threshold.yaml").write_text("threshold: 7\n")
    (d / "pc_bad.yaml").write_text("threshold: [0.5\n")
    (d / "pc_judge.yaml").write_text("judge_yes: Zebra\n")  # not in the embedded vocabulary
    long_question = "What is " + "1 + " * 300 + "1?"  # longer than the random models' 512 positions
    (d / "long.jsonl").write_text(json.dumps({"prompt": probs[0][0]}) + "\n" + json.dumps(
        {"question": long_question, "answer": "#### 301"}) + "\n")
    (d / "huge.jsonl").write_text(json.dumps({"prompt": "x" * 20_000_000}) + "\n")  # a 20 MB record
    (d / "badline.jsonl").write_text(json.dumps({"prompt": probs[0][0]}) + "\n{not json\n")
    from parse_jax.speculation.eagle3 import save_eagle3
    from tests.checkpoints.runs_fixture import write_run
    from tests.speculation.test_eagle3 import random_head
    from tests.test_engine import DRAFT, TARGET

    save_eagle3(random_head(TARGET), d / "head")  # an EAGLE-3 head for the pair's target
    write_run(d / "draft_run", DRAFT, steps=(1,))  # a user's training run: no run.json, so no config
    return d


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


P = "PAIR"  # replaced by the pair folder
W = "WORK"  # replaced by the work folder
PROMPT = "( 1 + 2 ) :"

# (args, text the one error line must contain, quiet)
CASES = [
    # generate
    (["generate", "--pair", P, "--max-new-tokens", "0", PROMPT], "--max-new-tokens must be >= 1, got 0", False),
    (["generate", "--pair", P, "--max-new-tokens", "2.5", PROMPT], "--max-new-tokens: invalid int value: '2.5'",
     False),
    (["generate", "--pair", P, "--temperature", "-1", PROMPT], "--temperature must lie in [0, inf), got -1", False),
    (["generate", "--pair", P, "--temperature", "nan", PROMPT], "--temperature must be a finite number", False),
    (["generate", "--pair", P, "--top-p", "0", PROMPT], "--top-p must lie in (0, 1], got 0", False),
    (["generate", "--pair", P, "--top-p", "1.5", PROMPT], "--top-p must lie in (0, 1], got 1.5", False),
    (["generate", "--pair", P, "--top-k", "-1", PROMPT], "--top-k must be >= 0, got -1", False),
    (["generate", "--pair", P, "--seed", "-1", PROMPT], "--seed must be >= 0, got -1", False),
    (["generate", "--pair", P, "--seed", str(2**70), PROMPT], f"--seed must be <= {SEED_MAX}, got {2**70}", False),
    # one seed range, the one generation takes, checked at the flag (2**31 failed once the models had loaded)
    (["generate", "--pair", P, "--seed", str(2**31), PROMPT], f"--seed must be <= {SEED_MAX}, got {2**31}", False),
    (["generate", "--pair", P, "--chat", "   ", PROMPT], "prompt 0 is empty or only whitespace", False),
    (["generate", "--pair", P, "( 1 \udcff", PROMPT], "prompt 0 is not valid UTF-8 text", False),
    (["generate", "--pair", P, "--coordinator-timeout", "0", PROMPT], "--coordinator-timeout must be >= 1", False),
    (["generate", "--model", f"{P}/target", "--draft", f"{W}/draft_run", "--mode", "parse", PROMPT],
     "--draft-config-from DIR", True),
    (["generate", "--pair", P, "--threshold", "7", PROMPT], "--threshold must lie in [0, 1], got 7", False),
    (["generate", "--pair", P, "--threshold", "-1", PROMPT], "--threshold must lie in [0, 1], got -1", False),
    (["generate", "--pair", P, "--threshold", "inf", PROMPT], "--threshold must be a finite number, got inf", False),
    (["generate", "--pair", P, "--max-prefixes", "0", PROMPT], "--max-prefixes must be >= 1, got 0", False),
    (["generate", "--pair", P, "--max-prefixes", "2.5", PROMPT], "--max-prefixes: invalid int value: '2.5'", False),
    (["generate", "--pair", P, "--gamma", "0", PROMPT], "--gamma must be >= 1, got 0", False),
    (["generate", "--pair", P, "--eagle3-tree", "-1", PROMPT], "--eagle3-tree must be >= 0, got -1", False),
    (["generate", "--pair", P, "--mesh", "data=1,data=1", PROMPT], "axis 'data' given twice", False),
    (["generate", "--pair", P, "--mesh", "data=x", PROMPT], "mesh axis data must be an integer, got 'x'", False),
    (["generate", "--pair", P, "--mesh", "gpu=2", PROMPT], "unknown mesh axes ['gpu']", False),
    (["generate", "--pair", P, "--mesh", f"{W}/mesh_bad.yaml", PROMPT], "mesh_bad.yaml is not valid YAML at line",
     False),
    (["generate", "--pair", P, "--mesh", f"{W}/nowhere.yaml", PROMPT], "mesh config file not found", False),
    (["generate", "--pair", P, "--mesh", "", PROMPT], "--mesh '' names no mesh axis: give axis=size pairs", False),
    (["lower", "--mesh", " , ", "--memory-only"], "--mesh ' , ' names no mesh axis", False),
    # a flag the command does not take: named by that command, with its --help
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--foo"],
     "unrecognized arguments: --foo (see parse-jax eval --help)", False),
    (["export", "--model", f"{P}/target", "--out", f"{W}/exported", "--mesh", "data=1"],
     "unrecognized arguments: --mesh data=1 (see parse-jax export --help)", False),
    (["generate", "--pair", P, "--parse-config", f"{W}/none.yaml", PROMPT], "cannot read --parse-config", False),
    (["generate", "--pair", P, "--parse-config", f"{W}/pc_list.yaml", PROMPT], "must hold a mapping", False),
    (["generate", "--pair", P, "--parse-config", f"{W}/pc_typo.yaml", PROMPT], "unknown PARSE setting 'treshold'",
     False),
    (["generate", "--pair", P, "--parse-config", f"{W}/pc_yes.yaml", PROMPT], "judge_yes must be a string, got True",
     False),
    (["generate", "--pair", P, "--parse-config", f"{W}/pc_float.yaml", PROMPT],
     "max_prefixes must be an integer, got 2.5", False),
    (["generate", "--pair", P, "--parse-config", f"{W}/pc_threshold.yaml", PROMPT],
     "threshold must lie in [0, 1], got 7", False),
    (["generate", "--pair", P, "--parse-config", f"{W}/pc_bad.yaml", PROMPT], "pc_bad.yaml is not valid YAML", False),
    (["generate", "--pair", P, "--set", "threshold=5", PROMPT], "--set threshold=5: threshold must lie in [0, 1]",
     False),
    (["generate", "--pair", P, "--set", "threshold", PROMPT], "--set 'threshold': expected KEY=VALUE", False),
    (["generate", "--pair", P, "--set", "thresh=0.3", PROMPT], "unknown PARSE setting 'thresh'", False),
    (["generate", "--pair", P, "--set", "stride=2.5", PROMPT], "stride must be an integer, got 2.5", False),
    (["generate", "--pair", P, "--eos-ids", "a,b", PROMPT], "--eos-ids must be comma-separated token ids", False),
    (["generate", "--pair", P, "--eos-ids", "-1", PROMPT], "--eos-ids must be >= 0, got -1", False),
    (["generate", "--pair", P, "--eos-ids", "100000", PROMPT], "--eos-ids must be <=", True),
    (["generate", "--pair", P, "--no-thinking", PROMPT], "--no-thinking applies to the chat template", False),
    (["generate", "--pair", P, "--mode", "warp", PROMPT], "unknown mode 'warp'", False),
    (["generate", "--model", "/typo", PROMPT], "/typo", True),
    # the engine's own checks, reached through the CLI (judge words in the vocabulary, the cache size)
    (["generate", "--pair", P, "--parse-config", f"{W}/pc_judge.yaml", PROMPT], "judge_yes 'Zebra'", True),
    (["generate", "--pair", P, "--mode", "parse", "--max-new-tokens", "100000", PROMPT], "100000", True),
    # bench: the old result must survive every one of these
    (["bench", "--pair", P, "--json", f"{W}/good.json", "--n", "0"], "--n must be >= 1, got 0", False),
    (["bench", "--pair", P, "--json", f"{W}/good.json", "--repeats", "0"], "--repeats must be >= 1, got 0", False),
    (["bench", "--pair", P, "--json", f"{W}/good.json", "--batch-size", "-1"], "--batch-size must be >= 1, got -1",
     False),
    (["bench", "--pair", P, "--json", f"{W}/good.json", "--max-new-tokens", "0"],
     "--max-new-tokens must be >= 1, got 0", False),
    (["bench", "--pair", P, "--json", f"{W}/good.json", "--threshold", "5"], "--threshold must lie in [0, 1]", False),
    (["bench", "--pair", P, "--out", f"{W}/bench", "--n", "0"], "--n must be >= 1", False),
    (["bench", "--pair", P, "--out", f"{W}/new/sub", "--repeats", "-2"], "--repeats must be >= 1", False),
    (["bench", "--pair", P, "--n", "2.5"], "--n: invalid int value: '2.5'", False),
    (["bench", "--pair", P, "--json", f"{W}/bench"], "it is a folder", False),
    (["bench", "--pair", P, "--json", f"{W}/file/b.json"], "cannot write", False),
    (["bench", "--pair", P, "--data", f"{W}/none.jsonl"], "cannot read data file", False),
    (["bench", "--pair", P, "--data", f"{W}/data.jsonl", "--n", "50"], "--n 50, but", False),
    (["bench", "--pair", P, "--chat", "on"], "--chat and --no-thinking apply to --data records", False),
    (["bench", "--pair", P, "--modes", "target,warp"], "warp", False),
    (["bench", "--pair", P, "--json", f"{W}/good.json", "--seed", str(2**31)], f"--seed must be <= {SEED_MAX}",
     False),
    (["bench", "--pair", P, "--rounds", "multi"], "--rounds does not apply here", False),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--mode", "parse-multi",
      "--rounds", "single"], "--rounds does not apply to --mode parse-multi", False),
    (["bench", "--pair", P, "--json", f"{W}/good.json", "--eos-ids", "1,x"], "--eos-ids must be comma-separated",
     False),
    # sweep and calibrate
    (["sweep", "--pair", P, "--param", "threshold", "--values", "0.1,2", "--out", f"{W}/sweep"],
     "threshold must lie in [0, 1], got 2", False),
    (["sweep", "--pair", P, "--param", "max_prefixes", "--values", "2.5", "--out", f"{W}/sweep"], "must be numbers",
     False),
    (["sweep", "--pair", P, "--param", "threshold", "--values", "0.5", "--n", "0", "--out", f"{W}/sweep"],
     "--n must be >= 1", False),
    (["sweep", "--pair", P, "--param", "threshold", "--values", "0.5", "--out", f"{W}/file"],
     "cannot write to output folder", False),
    (["calibrate", "--pair", P, "--thresholds", "0.5,1.5", "--out", f"{W}/sweep"],
     "--thresholds must lie in [0, 1], got 1.5", False),
    (["calibrate", "--pair", P, "--thresholds", ",", "--out", f"{W}/sweep"], "at least one threshold", False),
    (["calibrate", "--pair", P, "--tolerance", "1", "--out", f"{W}/sweep"], "--tolerance must lie in [0, 1)", False),
    (["calibrate", "--pair", P, "--tolerance", "-0.1", "--out", f"{W}/sweep"], "--tolerance must lie in [0, 1)",
     False),
    (["calibrate", "--pair", P, "--threshold", "0.5", "--out", f"{W}/sweep"], "calibrate chooses the threshold",
     False),
    (["calibrate", "--pair", P, "--set", "threshold=0.3", "--out", f"{W}/sweep"],
     "calibrate chooses the threshold: give candidates with --thresholds, not --set threshold=0.3", False),
    (["calibrate", "--pair", P, "--data", f"{W}/badline.jsonl", "--on-bad-line", "skip", "--tolerance", "1",
      "--out", f"{W}/sweep"], "--tolerance must lie in [0, 1)", False),  # the flag its errors suggest exists
    # eval: nothing written before everything is checked
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--temperature", "-1"],
     "--temperature must lie in [0, inf), got -1", False),
    (["eval", "--model", "/typo", "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl"], "/typo", True),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/results.jsonl", "--mode", "target"],
     "results.jsonl was started on a different data file", False),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--batch-size", "0"],
     "--batch-size must be >= 1, got 0", False),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--threshold", "2"],
     "--threshold must lie in [0, 1], got 2", False),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/bench"], "is a folder", False),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--eos-ids", "99999"],
     "--eos-ids must be <=", True),
    (["eval", "--pair", P, "--data", f"{W}/gsm.jsonl", "--out", f"{W}/new.jsonl", "--chat", "on", "--mode",
      "target"], "no chat template", True),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--no-thinking", "--chat",
      "off"], "--no-thinking applies to the chat template", False),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--mode", "all"],
     "eval runs one mode", False),
    # eval: every record checked against the mode before the results file is written
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--seed", str(2**31)],
     f"--seed must be <= {SEED_MAX}", False),
    (["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--max-new-tokens", "100000"],
     "line 1: the record has", True),
    # -qq: errors only (GSM8K text is outside the embedded vocabulary, which a warning says)
    (["eval", "--pair", P, "--data", f"{W}/long.jsonl", "--out", f"{W}/new.jsonl", "--mode", "target", "-q"],
     "long.jsonl: 1 record(s) cannot be run: line 2: the record has", True),
    (["eval", "--pair", P, "--data", f"{W}/huge.jsonl", "--out", f"{W}/new.jsonl"], "line 1: 'prompt' is not", False),
    (["eval", "--pair", P, "--eagle3", f"{W}/head", "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl",
      "--mode", "eagle3", "--eagle3-tree", "2", "--temperature", "0.7"], "tree drafting is greedy only", True),
    (["eval", "--model", f"{P}/target", "--data", f"{W}/data.jsonl", "--out", f"{W}/new.jsonl", "--mode", "eagle3"],
     "mode 'eagle3' needs an EAGLE-3 head", True),
    # train and train-eagle3
    (["train", "--recipe", "pair_default", "--out", f"{W}/file"], "--out", False),
    (["train", "--recipe", "pair_default", "--out", ""], "--out '' is empty; give the run's folder", False),
    (["train", "--recipe", "nope", "--out", f"{W}/t"], "known recipes: pair_default (in", False),
    (["train", "--recipe", "pair_default", "--steps", "0", "--out", f"{W}/t"], "--steps must be >= 1, got 0", False),
    (["train", "--recipe", f"{W}/no_recipe.yaml", "--out", f"{W}/t"], "no_recipe", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--lr", "nan"], "--lr must be a finite number, got nan", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--lr", "inf"], "--lr must be a finite number, got inf", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--lr", "0"], "--lr must lie in (0, inf), got 0", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--lr", "-1"], "--lr must lie in (0, inf), got -1", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/file"], "is a file", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--steps", "2.5"], "--steps: invalid int value", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--unroll", "0"], "--unroll must be >= 1", False),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--seq-len", "4", "--samples", "2"],
     "--seq-len 4: no row keeps a response token after its prompt, so the head would train on nothing", True),
    (["train-eagle3", "--pair", P, "--out", f"{W}/h", "--resume", "--steps", "1", "--samples", "4"],
     "nothing to resume", True),  # before the teacher pass (which wrote samples.json)
    (["train", "--recipe", "pair_default", "--steps", "1", "--out", f"{W}/t", "--grow-from", f"{W}/no_model"],
     "--grow-from", True),  # before the draft phase trains
    (["train", "--recipe", "pair_default", "--steps", "1", "--out", f"{W}/t", "--grow-from", f"{P}/draft"],
     "its config is not the recipe's target_model (hidden_size: 64 there, 128 in the recipe;", True),
    # convert
    (["convert", "--hf", f"{W}/no_hf", "--out", f"{W}/conv"], "no_hf", True),
    # convert: the output is checked before a tensor is read
    (["convert", "--hf", f"{W}/no_hf", "--out", f"{W}/bench"], "already exists", False),
    (["convert", "--hf", f"{W}/no_hf", "--out", f"{W}/file/conv"], "is a file, not a folder", False),
]


@pytest.mark.parametrize("args, message, quiet", CASES, ids=[" ".join(c[0][:1] + c[0][3:6]) for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_no_file(work, pair_dir, capsys, args, message, quiet):
    args = [a.replace(P, str(pair_dir)).replace(W, str(work)) if isinstance(a, str) else a for a in args]
    before = _tree(work)
    rc = main(args + (["-q"] if quiet else []))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (args, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"parse-jax {args[0]}: error: ") and message in lines[0], err
    assert "Traceback" not in err
    assert len(lines[0]) < 1000, lines[0][:300]  # a huge value (a 20 MB record) is cut, never echoed whole
    assert _tree(work) == before  # every old file byte-identical; nothing new (no placeholder, no temporary)


def test_at_least_sixty_cases():
    assert len(CASES) >= 60


def test_typo_then_corrected_eval_works(work, pair_dir, capsys, tmp_path):
    """A start with a typo leaves no file, so the corrected rerun runs (no "started with other
    settings")."""
    out = tmp_path / "r.jsonl"
    base = ["eval", "--pair", str(pair_dir), "--data", str(work / "data.jsonl"), "--out", str(out), "--mode",
            "target", "--max-new-tokens", "4", "--no-progress", "-q"]
    assert main(base + ["--temperature", "-1"]) == 2 and not out.exists()
    assert main([*base[:3], "/typo", *base[4:]]) == 2 and not out.exists()
    capsys.readouterr()
    assert main(base) == 0, capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 3  # header + 2 records


# Valid input that was refused (or that stopped part-way): each runs to the end, exit 0.
VALID = [
    # modes that need no draft load none
    ["generate", "--model", f"{P}/target", "--eagle3", f"{W}/head", "--mode", "eagle3", "--max-new-tokens", "4",
     PROMPT],
    ["bench", "--model", f"{P}/target", "--modes", "target", "--n", "1", "--repeats", "1", "--max-new-tokens", "2",
     "--json", "TMP/b.json", "--no-progress"],
    # the top of the one seed range, in generation and in eval (whose per-batch seeds stay inside it)
    ["generate", "--pair", P, "--seed", str(SEED_MAX), "--temperature", "0.7", "--max-new-tokens", "4", PROMPT],
    ["eval", "--pair", P, "--data", f"{W}/data.jsonl", "--out", "TMP/r.jsonl", "--mode", "target", "--seed",
     str(SEED_MAX), "--temperature", "0.7", "--max-new-tokens", "4", "--no-progress"],
    # --on-bad-line skip where the errors suggest it
    ["bench", "--pair", P, "--data", f"{W}/badline.jsonl", "--on-bad-line", "skip", "--modes", "target", "--n", "1",
     "--repeats", "1", "--max-new-tokens", "2", "--json", "TMP/c.json", "--no-progress"],
    # a mode that needs no draft does not load one (this folder would fail to load: the parse case above)
    ["generate", "--model", f"{P}/target", "--draft", f"{W}/draft_run", "--mode", "target", "--max-new-tokens", "2",
     PROMPT],
    ["eval", "--model", f"{P}/target", "--draft", f"{W}/draft_run", "--data", f"{W}/data.jsonl", "--out",
     "TMP/d.jsonl", "--mode", "target", "--max-new-tokens", "2", "--no-progress"],
]


@pytest.mark.parametrize("args", VALID, ids=[" ".join(a[:1] + a[3:7]) for a in VALID])
def test_valid_input_runs(work, pair_dir, capsys, tmp_path, args):
    args = [a.replace(P, str(pair_dir)).replace(W, str(work)).replace("TMP", str(tmp_path)) for a in args]
    rc = main(args + ["-q"])
    assert rc == 0, capsys.readouterr().err


def test_eval_skips_a_record_too_long_for_the_models(work, pair_dir, capsys, tmp_path):
    """--on-bad-line skip skips a record longer than the positions (reported by its line, in the summary too);
    without it nothing is written (the CASES above), so fixing the data and rerunning starts cleanly."""
    out = tmp_path / "r.jsonl"
    rc = main(["eval", "--pair", str(pair_dir), "--data", str(work / "long.jsonl"), "--out", str(out), "--mode",
               "target", "--max-new-tokens", "4", "--on-bad-line", "skip", "--no-progress"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert "skipping bad line 2: the record has" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in rows[1:]] == [1]
    summary = json.loads((tmp_path / "r.summary.json").read_text())
    assert [b["line"] for b in summary["bad_lines"]] == [2]


def test_bench_checks_data_records_up_front_and_skips_them_when_asked(work, pair_dir, capsys, tmp_path):
    """bench --data checks every record against its modes before any run, as eval does: a record longer than the
    positions is refused by its line (nothing written), and --on-bad-line skip leaves it out with a warning."""
    args = ["bench", "--pair", str(pair_dir), "--data", str(work / "long.jsonl"), "--modes", "target",
            "--max-new-tokens", "4", "--repeats", "1", "--no-progress"]
    rc = main([*args, "--json", str(tmp_path / "a.json")])
    _, err = capsys.readouterr()
    assert rc == 2 and "1 record(s) cannot be run: line 2: the record has" in err and "--on-bad-line skip" in err
    assert not (tmp_path / "a.json").exists()
    rc = main([*args, "--on-bad-line", "skip", "--json", str(tmp_path / "b.json")])
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert "skipping line 2: the record has" in err
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["n"] == 1 and "target" in res["modes"]  # the record that fits, alone


def test_a_rerun_starts_over_a_header_only_results_file(work, pair_dir, capsys, tmp_path):
    """A results file holding only a header (a run that stopped before its first record) does not block the
    corrected rerun, whatever settings or data it was started with; one holding records still does."""
    out = tmp_path / "r.jsonl"
    header = {"type": "header", "version": 1, "data": "elsewhere.jsonl", "data_sha256": "0" * 64,
              "settings": {"mode": "target", "max_new_tokens": 100000}}
    out.write_text(json.dumps(header) + "\n")
    base = ["eval", "--pair", str(pair_dir), "--data", str(work / "data.jsonl"), "--out", str(out), "--mode",
            "target", "--max-new-tokens", "4", "--no-progress", "-q"]
    assert main(base) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["settings"]["max_new_tokens"] == 4 and len(rows) == 3
    capsys.readouterr()
    assert main([*base[:-3], "8", "--no-progress", "-q"]) == 2  # records of other settings: refused
    assert "was started with other settings" in capsys.readouterr().err


def test_a_sampled_eval_resumed_at_another_batch_size_draws_what_a_whole_run_draws(work, pair_dir, capsys, tmp_path):
    """Each record draws from its own seed (--seed + its line): a sampled run stopped by --limit and resumed at
    another --batch-size writes the outputs of a whole run. A sampled results file of an earlier
    version (its header records batch_size, its draws depended on the batch) is refused in one line."""
    base = ["eval", "--pair", str(pair_dir), "--data", str(work / "data.jsonl"), "--mode", "sd", "--set",
            "schedule=fixed", "--max-new-tokens", "6", "--no-progress", "-q", "--temperature", "1.5", "--seed", "3"]
    whole = tmp_path / "whole.jsonl"
    assert main([*base, "--out", str(whole), "--batch-size", "2"]) == 0, capsys.readouterr().err
    out = tmp_path / "s.jsonl"
    assert main([*base, "--out", str(out), "--batch-size", "2", "--limit", "1"]) == 0
    assert json.loads(out.read_text().splitlines()[0])["settings"]["draws"] == "per-record"
    assert main([*base, "--out", str(out), "--batch-size", "1", "--batching", "fixed"]) == 2  # batching: a setting
    assert main([*base, "--out", str(out), "--batch-size", "1"]) == 0
    outputs = lambda path: [r["output"] for r in map(json.loads, path.read_text().splitlines()[1:])]  # noqa: E731
    assert len(outputs(out)) == 2 and outputs(out) == outputs(whole)
    assert main([*base, "--out", str(tmp_path / "s7.jsonl"), "--seed", "7"]) == 0
    assert outputs(tmp_path / "s7.jsonl") != outputs(whole)  # the draws are real
    old = tmp_path / "old.jsonl"
    lines = out.read_text().splitlines()
    header = json.loads(lines[0])
    header["settings"].pop("draws")
    header["settings"]["batch_size"] = 2
    old.write_text("\n".join([json.dumps(header), lines[1]]) + "\n")  # one record done by an earlier version
    capsys.readouterr()
    assert main([*base, "--out", str(old), "--batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "earlier version whose sampled draws depended on each record's batch" in err[0]
    greedy = tmp_path / "g.jsonl"
    args = [*base[:-4], "--out", str(greedy)]
    assert main([*args, "--batch-size", "2", "--limit", "1"]) == 0
    assert "draws" not in json.loads(greedy.read_text().splitlines()[0])["settings"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.subprocess
@pytest.mark.parametrize("process_id, waits_for", [(0, "1 other process(es) of 2"), (1, "process 0 (the coordinator)")])
def test_coordinator_with_no_peer_gives_up_with_one_line(process_id, waits_for):
    """--coordinator with nobody to meet: one line naming what it waited for, exit 2, after --coordinator-timeout
    (jax alone aborts with SIGABRT and a C++ stack)."""
    address = f"127.0.0.1:{_free_port()}"
    proc = subprocess.run([sys.executable, "-m", "parse_jax.cli", "generate", "--coordinator", address,
                           "--num-processes", "2", "--process-id", str(process_id), "--coordinator-timeout", "3",
                           "-q", PROMPT], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("parse-jax generate: error: no multi-host start after 3 s"), lines
    assert waits_for in lines[0] and address in lines[0]
