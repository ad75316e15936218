"""The resumable eval loop on a real (random) model: an interrupted run, resumed, gives the totals of an
uninterrupted one and never counts a record twice; torn writes, changed data and changed settings are handled."""

import json

import pytest

from parse_jax.errors import ConfigError, InputError
from parse_jax.harness.eval.data import file_sha256, load_records, write_task_jsonl
from parse_jax.harness.eval.results import ResultsFile, build_prompt, make_header, run_eval, summary_path, write_summary
from parse_jax.harness.runs import RunSettings, mode_runner
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.runtime.requests import GenerateResult
from parse_jax.tasks import TOKENIZER_DIR, load_task
from tests.test_engine import TARGET

TASK = load_task()
SETTINGS = {"mode": "target", "max_new_tokens": 6, "seed": 0}
RUNNER = mode_runner(TARGET, None, None, "target")


def _generate(prompts, offset):
    return RUNNER(prompts, SETTINGS["max_new_tokens"], SETTINGS["seed"])


class Interrupt(Exception):
    pass


def _open(out, data, settings=SETTINGS):
    return ResultsFile.open(out, make_header(data, file_sha256(data), settings))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_task_jsonl(TASK, 8, tmp_path_factory.mktemp("d") / "data.jsonl", seed=5)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("u") / "results.jsonl"
    records, _ = load_records(data, TASK)
    summary = run_eval(records, _generate, _open(out, data), RunSettings(batch_size=2, progress=False), task=TASK,
                       log=lambda s: None)
    return summary, out


def test_the_progress_bar_shows_the_running_accuracy(data, tmp_path, capsys):
    """The bar's acc= is correct records over records done (a record's own grade once overwrote the running count:
    150% was shown)."""
    import re

    records, _ = load_records(data, TASK)
    solutions = {r.prompt: r.reference for r in records}

    def half_right(prompts, offset):  # the first prompt of each call right, the second wrong
        texts = [f"answer {solutions[p]}" if i == 0 else "answer x" for i, p in enumerate(prompts)]
        return GenerateResult(texts=texts, tokens=[[1] for _ in texts], stats={})

    summary = run_eval(records, half_right, _open(tmp_path / "r.jsonl", data),
                       RunSettings(batch_size=2, progress=True, batching="fixed"), task=TASK, log=lambda s: None)
    assert summary["correct"] == summary["n"] // 2 > 0
    shown = [float(x) for x in re.findall(r"acc=([\d.]+)%", capsys.readouterr().err)]
    assert shown and max(shown) <= 100.0
    assert shown[-1] == pytest.approx(100 * summary["correct"] / summary["n"], abs=0.05)


def test_a_limit_below_the_records_done_reports_the_first_n(data, uninterrupted, tmp_path):
    """lm-eval's --limit over a results file that already holds all 8: the run reports its first 2 records (and
    generates nothing), where it once reported all 8; the file keeps them all for a later run."""
    import shutil

    _, full_out = uninterrupted
    out = tmp_path / "results.jsonl"
    shutil.copy(full_out, out)
    records, _ = load_records(data, TASK, limit=2)

    def must_not_run(prompts, offset):
        raise AssertionError("every record is done")

    summary = run_eval(records, must_not_run, _open(out, data), RunSettings(batch_size=2, progress=False), task=TASK,
                       log=lambda s: None)
    first = _results(full_out)[:2]
    assert summary["n"] == 2 and summary["correct"] == sum(bool(r["correct"]) for r in first)
    assert len(_results(out)) == 8


def _results(path):
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


FIXED_2 = RunSettings(batch_size=2, progress=False, batching="fixed")  # one batch of 2 records per call


def test_continuous_batching_takes_eight_batches_per_call(data, tmp_path):
    records, _ = load_records(data, TASK)
    calls = []

    def counting(prompts, offset):
        calls.append(len(prompts))
        return _generate(prompts, offset)

    run_eval(records, counting, _open(tmp_path / "r.jsonl", data), RunSettings(batch_size=1, progress=False),
             task=TASK, log=lambda s: None)
    assert calls == [8]  # 8 records, batch size 1: one call of 8 batches (the resume granularity)


def test_interrupted_then_resumed_equals_uninterrupted(data, uninterrupted, tmp_path):
    full, full_out = uninterrupted
    assert full["n"] == 8
    records, _ = load_records(data, TASK)
    out = tmp_path / "results.jsonl"
    calls = []

    def dies_on_third_batch(prompts, offset):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise Interrupt
        return _generate(prompts, offset)

    with pytest.raises(Interrupt):
        run_eval(records, dies_on_third_batch, _open(out, data), FIXED_2, task=TASK,
                 log=lambda s: None)
    assert len(_results(out)) == 4  # the two finished batches are on disk
    logs, resumed_prompts = [], []

    def counting(prompts, offset):
        resumed_prompts.extend(prompts)
        return _generate(prompts, offset)

    resumed = run_eval(records, counting, _open(out, data), FIXED_2, task=TASK,
                       log=logs.append)
    assert "4 of 8 records already done" in logs[0]
    assert resumed_prompts == [r.prompt for r in records[4:]]  # only what was missing ran
    rows = _results(out)
    assert len(rows) == 8 and len({r["key"] for r in rows}) == 8
    for key in ("n", "correct", "accuracy", "accuracy_ci95", "no_answer", "new_tokens"):
        assert resumed[key] == full[key], key
    by_key = {r["key"]: r for r in _results(full_out)}
    assert all(r["output"] == by_key[r["key"]]["output"] for r in rows)  # greedy: the same texts
    again = run_eval(records, dies_on_third_batch, _open(out, data), RunSettings(batch_size=8, progress=False),
                     task=TASK, log=lambda s: None)
    assert again["n"] == 8 and len(_results(out)) == 8  # a finished run reruns nothing


def test_results_are_graded_by_the_task(uninterrupted):
    _, out = uninterrupted
    for r in _results(out):
        assert r["correct"] == (r["extracted"] == r["reference"])
        assert r["new_tokens"] <= SETTINGS["max_new_tokens"]


def test_torn_last_line_is_dropped_and_rerun(data, uninterrupted, tmp_path):
    _, full_out = uninterrupted
    out = tmp_path / "r.jsonl"
    lines = full_out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]) + lines[5][:25])  # header + 4 results + a torn 5th
    rf = _open(out, data)
    assert len(rf.results) == 4 and out.read_text() == "".join(lines[:5])
    records, _ = load_records(data, TASK)
    summary = run_eval(records, _generate, rf, RunSettings(batch_size=2, progress=False), task=TASK, log=lambda s: None)
    assert summary["n"] == 8 and len(_results(out)) == 8


def test_changed_data_or_settings_against_old_results(data, uninterrupted, tmp_path):
    _, full_out = uninterrupted
    out = tmp_path / "r.jsonl"
    out.write_text(full_out.read_text())
    with pytest.raises(ConfigError, match="mode: 'target' then, 'parse' now"):
        _open(out, data, {**SETTINGS, "mode": "parse"})
    changed = tmp_path / "data.jsonl"
    changed.write_text(data.read_text().replace("(", "( ", 1))
    with pytest.raises(ConfigError, match="different data file"):
        _open(out, changed)
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(InputError, match="not a parse-jax eval results file"):
        _open(tmp_path / "other.jsonl", data)
    with pytest.raises(InputError, match="is a folder"):
        _open(tmp_path, data)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InputError, match="cannot write results file"):
        _open(blocker / "r.jsonl", data)


def test_summary_file_has_provenance(data, uninterrupted):
    summary, out = uninterrupted
    rf = _open(out, data)
    path = write_summary(rf, summary, {"git_commit": "x", "seed": 0}, [])
    assert path == summary_path(out) and path.name == "results.summary.json"
    doc = json.loads(path.read_text())
    assert doc["n"] == 8 and doc["settings"] == SETTINGS and doc["provenance"]["seed"] == 0


def test_gsm8k_records_through_the_harness(tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question": "2 + 2?", "answer": "#### 4"}, {"question": "10 * 100?", "answer": "#### 1,000"},
        {"question": "Anything?", "answer": "#### 3"}]) + "\n")
    replies = {"Question: 2 + 2?\nAnswer:": "2 + 2 = 4. #### 4", "Question: 10 * 100?\nAnswer:": "\\boxed{1,000}",
               "Question: Anything?\nAnswer:": "I cannot say."}

    def fixed(prompts, offset):  # a stand-in model that answers from a table: the harness is what is tested
        texts = [replies[p] for p in prompts]
        return GenerateResult(texts=texts, tokens=[[1] * len(t) for t in texts], stats={})

    records, _ = load_records(data, TASK)
    s = run_eval(records, fixed, _open(tmp_path / "r.jsonl", data), RunSettings(batch_size=2, progress=False),
                 log=lambda s: None)
    assert (s["n"], s["correct"], s["no_answer"]) == (3, 2, 1)


def test_chat_template_applies_to_questions_only():
    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    cfg = json.loads(tok.files["tokenizer_config.json"])
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} :{% endfor %}"
    chat_tok = Tokenizer({**tok.files, "tokenizer_config.json": json.dumps(cfg).encode()})
    from parse_jax.harness.eval.data import Record

    q = Record(1, "1:x", "gsm8k", "( 3 + 4 )", "7")
    ids = build_prompt(q, chat_tok, "auto", instruction="")
    assert ids == chat_tok.encode("<bos>( 3 + 4 ) :") and ids[0] == chat_tok.bos_id
    assert build_prompt(q, chat_tok, "off") == "Question: ( 3 + 4 )\nAnswer:"
    assert build_prompt(q, tok, "auto") == "Question: ( 3 + 4 )\nAnswer:"  # no template: plain text
    with pytest.raises(ConfigError, match="no chat template"):
        build_prompt(q, tok, "on")
    t = Record(2, "2:y", "task", "( 3 + 4 ) :", "7")
    assert build_prompt(t, chat_tok, "on") == "( 3 + 4 ) :"  # task prompts are the task's own format


def test_gsm8k_records_carry_both_lm_eval_scorings_the_prompt_and_the_stats(tmp_path):
    """Strict-match (`#### N`) and flexible-extract (the last number) side by side in each record and the summary,
    with Wilson intervals; each record holds its prompt, output, score and speculation stats."""
    data = tmp_path / "gsm.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question": "2 + 2?", "answer": "#### 4"}, {"question": "10 * 100?", "answer": "#### 1,000"},
        {"question": "3 * 3?", "answer": "#### 9"}, {"question": "Anything?", "answer": "#### 3"}]) + "\n")
    replies = {"Question: 2 + 2?\nAnswer:": "2 + 2 = 4. #### 4", "Question: 10 * 100?\nAnswer:": "1,000",
               "Question: 3 * 3?\nAnswer:": "#### 9, not 8", "Question: Anything?\nAnswer:": "#### 2"}

    def fixed(prompts, offset):  # a stand-in model that answers from a table: the harness is what is tested
        texts = [replies[p] for p in prompts]
        return GenerateResult(texts=texts, tokens=[[1] * len(t) for t in texts],
                              stats={"accepted_per_request": [3, 1], "drafts_per_request": [2, 2],
                                     "verify_passes": 2})

    records, _ = load_records(data, TASK)
    s = run_eval(records, fixed, _open(tmp_path / "r.jsonl", data), FIXED_2, log=lambda s: None)
    rows = _results(tmp_path / "r.jsonl")
    assert [r["correct_strict"] for r in rows] == [True, False, True, False]
    assert [r["correct_flexible"] for r in rows] == [True, True, False, False]
    assert [r["extracted_strict"] for r in rows] == ["4", None, "9", "2"]
    assert s["accuracy_strict"] == 0.5 and s["accuracy_flexible"] == 0.5
    assert s["accuracy_strict_ci95"][0] < 0.5 < s["accuracy_strict_ci95"][1]
    assert [r["prompt"] for r in rows] == list(replies) and [r["output"] for r in rows] == list(replies.values())
    assert rows[0]["stats"] == {"accepted_tokens": 3, "num_drafts": 2, "verify_passes": 2}
    assert s["acceptance_length"] == pytest.approx(1 + 8 / 8)
    assert (s["num_drafts"], s["num_accepted_tokens"]) == (8, 8) and "num_steps_drafted" not in s


def test_the_summary_totals_parse_counts_under_the_metrics_names():
    """PARSE records' counts sum to docs/metrics.md's names (the rate from the sums, not a mean of rates)."""
    from parse_jax.harness.eval.report import summarize

    rows = [{"key": str(i), "correct": True, "stats": {"accepted_tokens": a, "steps_drafted": k, "verify_passes": v}}
            for i, (a, k, v) in enumerate([(12, 4, 1), (3, 6, 3)])]
    s = summarize(rows)
    assert (s["num_steps_drafted"], s["num_verifications"]) == (10, 4)
    assert s["accepted_tokens_per_verification"] == pytest.approx(15 / 4) and "num_drafts" not in s


def test_each_record_says_what_the_auto_schedule_ran_and_the_summary_counts_them(data, tmp_path):
    """A call's decisions, in prompt order, each over its own prompts: every record carries the choice that ran it,
    and the summary (and its printed line) counts the records of each, over the whole file."""
    records, _ = load_records(data, TASK)

    def scheduled(prompts, offset):
        res = _generate(prompts, offset)
        half = len(prompts) // 2
        res.stats["schedule"] = [{"ran": "parse", "rounds": "single", "rows": half},
                                 {"ran": "target", "rounds": None, "rows": len(prompts) - half}]
        return res

    lines = []
    summary = run_eval(records, scheduled, _open(tmp_path / "r.jsonl", data), FIXED_2, task=TASK, log=lines.append)
    assert [r["ran"] for r in _results(tmp_path / "r.jsonl")] == ["parse-single", "target"] * 4
    assert summary["schedule_ran"] == {"parse-single": 4, "target": 4}
    assert "schedule auto ran parse-single for 4, target for 4 records (target: plain decoding)" in lines[-1]
    plain = run_eval(records, _generate, _open(tmp_path / "p.jsonl", data), FIXED_2, task=TASK, log=lambda s: None)
    assert "schedule_ran" not in plain and all("ran" not in r for r in _results(tmp_path / "p.jsonl"))
