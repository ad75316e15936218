"""Settings sources: --parse-config / --set on every PARSE command, --data for bench / sweep / calibrate (graded as
eval grades), --eos-ids, `generate --chat` in every mode with --no-thinking, and provenance from importlib.metadata.
Through `main()` in this process."""

import json

import pytest

from parse_jax.cli import build_parser, main
from parse_jax.cli.setup import parse_config_fields

PROMPT = "( 3 + 4 ) * ( 5 - 2 ) :"


def _main(capsys, *args):
    rc = main([*args, "-q"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_parse_config_file_then_set_then_flags(tmp_path):
    f = tmp_path / "pc.yaml"
    f.write_text('threshold: 0.9\nmax_prefixes: 3\njudge_yes: "Correct"\ndelimiter: "\\n\\n"\n')
    args = build_parser().parse_args(["generate", "--parse-config", str(f), "--set", "threshold=0.3", "--set",
                                      "max_prefixes=5", "--set", "judge_no=No", "--threshold", "0.2", "x"])
    assert parse_config_fields(args) == {"threshold": 0.2, "max_prefixes": 5, "judge_yes": "Correct",
                                          "delimiter": "\n\n", "judge_no": "No"}
    args = build_parser().parse_args(["eval", "--data", "d", "--out", "o", "--set", "delimiter='\\n'", "--set",
                                      "segmenter=hybrid"])
    assert parse_config_fields(args) == {"delimiter": "\\n", "segmenter": "hybrid"}  # single quotes: no escapes


def test_parse_config_takes_a_name_a_path_or_inline_json_and_exponent_floats(tmp_path):
    from parse_jax.settings import PARSE_CONFIG_DIR, ParseConfig

    def fields(*flags):
        return parse_config_fields(build_parser().parse_args(["generate", *flags, "x"]))

    named = fields("--parse-config", "qwen3_chat")
    assert named == fields("--parse-config", str(PARSE_CONFIG_DIR / "qwen3_chat.yaml"))
    assert ParseConfig.from_flat(**named) == ParseConfig.load("qwen3_chat")
    assert fields("--parse-config", '{"threshold": 0.25, "delimiter": ["\\n\\n", "."]}', "--set",
                  "max_prefixes=3") == {"threshold": 0.25, "delimiter": ("\n\n", "."), "max_prefixes": 3}
    assert fields("--set", "threshold=1e-1") == {"threshold": 0.1}
    f = tmp_path / "pc.yaml"
    f.write_text("threshold: 1e-1\n")
    assert fields("--parse-config", str(f)) == {"threshold": 0.1}


def test_a_parse_config_key_given_twice_is_one_error_line(tmp_path, capsys):
    f = tmp_path / "pc.yaml"
    f.write_text("threshold: 0.3\nmax_prefixes: 3\nthreshold: 0.9\n")
    rc, _, err = _main(capsys, "generate", "--parse-config", str(f), PROMPT)
    assert rc == 2 and err.strip().splitlines() == [
        f"parse-jax generate: error: --parse-config {f}: key 'threshold' is given twice (lines 1 and 3); give "
        "each setting once"], err
    rc, _, err = _main(capsys, "generate", "--parse-config", '{"threshold": 0.3', PROMPT)
    assert rc == 2 and "--parse-config JSON is not valid JSON at line 1" in err


def test_generate_with_a_parse_config_is_the_engine_with_those_settings(pair_dir, tmp_path, capsys):
    from parse_jax import ParseConfig, ParseEngine, load_pair

    f = tmp_path / "pc.yaml"
    f.write_text("threshold: 0.3\nmax_draft_tokens: 12\nsegmenter: stride\nstride: 3\n")
    target, draft = load_pair(pair_dir)
    expect = ParseEngine(target, draft, ParseConfig(threshold=0.3, max_draft_tokens=12, segmenter="stride", stride=3,
                                                    schedule="fixed")).generate([PROMPT], mode="parse",
                                                                                max_new_tokens=12)
    rc, out, err = _main(capsys, "generate", "--pair", str(pair_dir), "--mode", "parse", "--parse-config", str(f),
                         "--schedule", "fixed", "--max-new-tokens", "12", "--json", "--stats", PROMPT)
    assert rc == 0, err
    got = json.loads(out.splitlines()[0])
    assert got["tokens"] == [int(t) for t in expect.tokens[0]]
    assert got["stats"]["accepted_tokens"] == expect.stats["accepted_tokens"]


def test_bench_sweep_calibrate_on_a_data_file(pair_dir, tmp_path, capsys):
    from parse_jax.tasks import load_task

    probs = load_task().problems(3, 21)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in probs))
    common = ["--pair", str(pair_dir), "--data", str(data), "--max-new-tokens", "6", "--batch-size", "3",
              "--repeats", "1", "--no-progress"]
    out = tmp_path / "bench.json"
    rc, _, err = _main(capsys, "bench", *common, "--modes", "target,parse", "--json", str(out), "--set",
                       "threshold=0.3", "--eos-ids", "1")
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["n"] == 3 and res["task"] == "data:data.jsonl" and res["split"] == "data"  # every record
    assert res["data"] == str(data) and len(res["data_sha256"]) == 64
    assert res["parse_config"]["threshold"] == 0.3 and res["eos_ids"] == [1]
    rc, _, err = _main(capsys, "sweep", *common, "--param", "threshold", "--values", "0.2", "--out",
                       str(tmp_path / "sweep"))
    assert rc == 0, err
    sweep = json.loads((tmp_path / "sweep" / "sweep_threshold.json").read_text())
    assert sweep["split"] == "data" and sweep["prompts"] == [p for p, _ in probs]
    rc, _, err = _main(capsys, "calibrate", *common, "--thresholds", "0.6", "--out", str(tmp_path / "cal"))
    assert rc in (0, 1), err
    cal = json.loads((tmp_path / "cal" / "calibrate.json").read_text())
    assert cal["split"] == "data" and cal["n"] == 3


def test_data_task_grades_as_eval_does(pair_dir, tmp_path):
    from parse_jax import load_pair
    from parse_jax.harness.eval.data import load_records
    from parse_jax.harness.eval.results import DataTask

    data = tmp_path / "gsm.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    target, _ = load_pair(pair_dir)
    task = DataTask(data, load_records(data)[0], target.tokenizer, chat="off")
    (prompt, reference), = task.problems(1)
    assert prompt == "Question: What is 2 + 3?\nAnswer:" and reference == "5"
    assert task.grade(prompt, "so it is \\boxed{5}") and not task.grade(prompt, "#### 6")


def test_eval_parse_config_on_gsm8k_records_and_its_header(pair_dir, tmp_path, capsys):
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(2)))
    f = tmp_path / "pc.yaml"
    f.write_text("threshold: 0.25\nmax_draft_tokens: 8\n")
    out = tmp_path / "r.jsonl"
    args = ["eval", "--pair", str(pair_dir), "--data", str(data), "--out", str(out), "--mode", "parse",
            "--parse-config", str(f), "--max-new-tokens", "6", "--batch-size", "2", "--no-progress"]
    rc, _, err = _main(capsys, *args)
    assert rc == 0, err
    header = json.loads(out.read_text().splitlines()[0])
    assert header["settings"]["parse_config"]["threshold"] == 0.25
    before = out.read_bytes()
    rc, _, err = _main(capsys, *args, "--set", "threshold=0.5")
    assert rc == 2 and "threshold" in err and out.read_bytes() == before  # another setting: refused, untouched


def test_eval_limit_takes_the_first_records_and_a_larger_limit_resumes(pair_dir, tmp_path, capsys):
    from parse_jax.harness.eval.data import write_task_jsonl
    from parse_jax.tasks import load_task

    data = write_task_jsonl(load_task(), 5, tmp_path / "d.jsonl", seed=3)
    data.write_text(data.read_text() + "{not json\n")  # line 6: bad, past every limit below
    out = tmp_path / "r.jsonl"
    args = ["eval", "--pair", str(pair_dir), "--data", str(data), "--out", str(out), "--mode", "sd",
            "--schedule", "fixed", "--max-new-tokens", "6", "--batch-size", "2", "--no-progress"]
    rc, _, err = _main(capsys, *args, "--limit", "2")
    assert rc == 0, err
    assert "line 6" not in err and "bad" not in err  # past the limit: not read, not reported
    header = json.loads(out.read_text().splitlines()[0])["settings"]
    assert header["batching"] == "continuous" and header["parse_config"]["schedule"] == "fixed"
    summary = json.loads((tmp_path / "r.summary.json").read_text())
    assert summary.get("bad_lines", []) == []
    rows = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    assert [r["line"] for r in rows] == [1, 2]
    prompts = [json.loads(x)["prompt"] for x in data.read_text().splitlines()[:5]]
    assert [r["prompt"] for r in rows] == prompts[:2] and all(r["output"] for r in rows)
    assert all(r["stats"]["num_drafts"] >= 1 and "accepted_tokens" in r["stats"] for r in rows)
    rc, _, err = _main(capsys, *args, "--limit", "4")
    assert rc == 0, err
    assert [json.loads(x)["line"] for x in out.read_text().splitlines()[1:]] == [1, 2, 3, 4]  # resumed, not redone
    rc, _, err = _main(capsys, *args, "--limit", "0")
    assert rc == 2 and "--limit must be >= 1, got 0" in err
    before = out.read_bytes()
    rc, _, err = _main(capsys, *args, "--limit", "4", "--batching", "fixed")
    assert rc == 2 and "batching" in err and out.read_bytes() == before  # another batching: refused, untouched
    rc, _, err = _main(capsys, *args, "--limit", "6")
    assert rc == 2 and "line 6" in err  # within the limit, the bad line is read and refused


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    from tests.models.hf_tiny import make_tiny_hf

    d = tmp_path_factory.mktemp("chat")
    return make_tiny_hf("qwen3", d / "t", seed=1, tokenizer="qwen"), make_tiny_hf("qwen3", d / "d", seed=2,
                                                                                  tokenizer="qwen")


@pytest.mark.parametrize("mode", ["target", "sd", "parse"])
def test_generate_chat_in_every_mode_with_no_thinking(chat_pair, capsys, mode):
    from parse_jax import ParseConfig, ParseEngine, load_model

    t_dir, d_dir = chat_pair
    target, draft = load_model(t_dir), load_model(d_dir)
    tok = target.tokenizer
    words = [w for w in ("yes", "no", " yes", " no", "A", "B", "1", "0") if len(tok.encode(w)) == 1]
    settings = {"judge_yes": words[0], "judge_no": words[1], "verify_suffix": " ok?", "delimiter": "."}
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert rendered != tok.apply_chat_template([{"role": "user", "content": "hi"}])  # the flag matters here
    ids = tok.encode(rendered)
    expect = ParseEngine(target, draft, ParseConfig(**settings)).generate([ids], mode=mode, max_new_tokens=6)
    sets = [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]
    rc, out, err = _main(capsys, "generate", "--model", str(t_dir), "--draft", str(d_dir), "--mode", mode, "--chat",
                         "--no-thinking", "--max-new-tokens", "6", "--json", *sets, "hi")
    assert rc == 0, err
    assert json.loads(out.splitlines()[0])["tokens"] == [int(t) for t in expect.tokens[0]]


def test_provenance_records_versions_and_a_commit_only_in_a_checkout(monkeypatch):
    from parse_jax.harness import provenance as provenance_module
    from parse_jax.harness.provenance import format_provenance, provenance

    p = provenance({"x": 1}, 0)
    assert set(p["versions"]) == {"parse-jax", "jax", "jaxlib", "flax", "orbax-checkpoint"}
    assert p["versions"]["jax"] and p["versions"]["parse-jax"]
    assert p["git_commit"] is None or len(p["git_commit"]) == 40
    monkeypatch.setattr(provenance_module, "source_checkout", lambda: None)  # a wheel install
    p = provenance()
    assert p["git_commit"] is None and p["git_dirty"] is None
    assert "unknown" not in json.dumps(p) and format_provenance(p).startswith("parse-jax ")


def test_eos_ids_none_writes_the_whole_budget(pair_dir, capsys):
    """`--eos-ids none` is the API's `eos_ids=[]`: no stop id, every row writes its whole budget; a given id stops
    the answer at its first occurrence, and the model's own stop ids end it no later than its budget."""
    def run(*flags):
        rc, out, err = _main(capsys, "generate", "--pair", str(pair_dir), "--mode", "target", "--max-new-tokens",
                             "40", "--json", *flags, PROMPT)
        assert rc == 0, err
        return json.loads(out.splitlines()[0])["tokens"]

    from parse_jax.cli.setup import eos_ids_from_args

    assert eos_ids_from_args(build_parser().parse_args(["generate", "--eos-ids", "None", "x"])) == []
    whole = run("--eos-ids", "none")
    assert len(whole) == 40
    stop = whole[2]
    assert run("--eos-ids", str(stop)) == whole[:whole.index(stop) + 1]
    own = run()
    assert own == whole[:len(own)]


def test_every_command_that_loads_models_takes_the_stop_ids_and_the_finite_check_flag():
    """--eos-ids and --skip-finite-check on generate, bench, sweep, calibrate and eval, as the docs present them (sweep
    and calibrate lacked --eos-ids; only generate and eval had --skip-finite-check)."""
    from parse_jax.cli.setup import eos_ids_from_args

    runs = {"generate": ["x"], "bench": [], "sweep": ["--param", "threshold", "--values", "0.5", "--out", "o"],
            "calibrate": ["--out", "o"], "eval": ["--data", "d", "--out", "o"]}
    for command, rest in runs.items():
        args = build_parser().parse_args([command, "--eos-ids", "3,5", "--skip-finite-check", *rest])
        assert eos_ids_from_args(args) == [3, 5] and args.skip_finite_check, command
