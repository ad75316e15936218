"""The bench harness on random models: every mode runs, the numbers are consistent with each other, and the files
written (JSON, Markdown, PNG) say the same thing."""

import json
import re

import numpy as np
import pytest

from parse_jax.engine import MODES, ParseConfig, ParseEngine
from parse_jax.errors import InputError
from parse_jax.harness.bench import run_bench, write_bench
from parse_jax.harness.runs import BENCH_MODES, RunSettings, check_modes, mode_config, write_json
from parse_jax.tasks import load_task
from parse_jax.utils.atomic import check_writable
from tests.test_engine import DRAFT, TARGET

MODES_RUN = ["sd", "sequential", "parse", "parse-multi", "draft"]


@pytest.fixture(scope="module")
def bench():
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(max_draft_tokens=8, segmenter="stride", stride=3, schedule="fixed"))
    lines = []
    res = run_bench(eng, load_task(), RunSettings(n=5, max_new_tokens=10, batch_size=5, repeats=2, progress=False),
                    modes=MODES_RUN, log=lines.append)
    return res, lines


def test_bench_on_five_problems(bench):
    res, lines = bench
    assert list(res["modes"]) == ["target", *MODES_RUN]
    for r in res["modes"].values():
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["correct"] == round(r["accuracy"] * 5)
        assert r["accuracy_ci95"][0] <= r["accuracy"] <= r["accuracy_ci95"][1]
        assert r["new_tokens"] > 0 and len(r["tokens_per_s_all"]) == 2
        np.testing.assert_allclose(r["tokens_per_s_all"], r["new_tokens"] / np.array(r["seconds_all"]))
        assert min(r["tokens_per_s_all"]) <= r["tokens_per_s"] <= max(r["tokens_per_s_all"])
        # a speed-up is the ratio of tokens/s to the target's, repeat by repeat
        np.testing.assert_allclose(r["speedup_all"], np.array(r["tokens_per_s_all"])
                                   / np.array(res["modes"]["target"]["tokens_per_s_all"]))
        assert r["speedup_min"] <= r["speedup_vs_target"] <= r["speedup_max"]
    assert res["modes"]["target"]["speedup_vs_target"] == pytest.approx(1.0)
    assert res["modes"]["target"]["new_tokens"] == res["modes"]["sd"]["new_tokens"]  # greedy sd == target
    parse = res["modes"]["parse"]
    assert parse["verify_passes"] == 1  # one for the batch of 5
    assert 0 <= parse["accepted_tokens"] <= parse["draft_tokens"]
    assert parse["accepted_per_pass"] == pytest.approx(parse["accepted_tokens"] / 5)  # one check per request
    assert res["modes"]["parse-multi"]["verify_passes"] >= parse["verify_passes"]  # multi round: >= 1 per round
    assert res["modes"]["target"]["target_passes_per_100_tokens"] >= 100.0  # one pass per token, per request
    assert res["modes"]["draft"]["target_passes"] == res["modes"]["draft"]["target_passes_per_100_tokens"] == 0
    assert res["modes"]["sequential"]["accepted_tokens"] == parse["accepted_tokens"]
    # the field's metrics (parse_jax/runtime/metrics.py), summed over the chunks and repeats' first pass
    sd = res["modes"]["sd"]
    assert sd["num_accepted_tokens"] == sd["accepted_tokens"] and sd["num_draft_tokens"] == sd["draft_tokens"]
    assert sd["acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    assert sd["acceptance_length"] == pytest.approx(1 + sum(sd["acceptance_rate_per_pos"]))
    assert sd["acceptance_length"] == pytest.approx(1 + sum(np.cumprod(sd["conditional_acceptance_rate_per_pos"])))
    assert len(sd["acceptance_rate_per_pos"]) == ParseConfig().speculation.gamma
    for m in ("parse", "parse-multi"):
        r = res["modes"][m]
        assert sum(r["first_rejected_step_hist"]) == r["num_verifications"] >= 5
        assert sum(r["accepted_score_hist"]) + sum(r["rejected_score_hist"]) == r["num_steps_drafted"] > 0
        assert r["accepted_tokens_per_verification"] == pytest.approx(r["accepted_tokens"] / r["num_verifications"])
    assert "acceptance_length" not in res["modes"]["target"]
    assert "| parse |" in lines[0] and "| parse-multi |" in lines[0]
    prov = res["provenance"]
    assert prov["jax"] and prov["device"] and prov["git_commit"] and prov["seed"] == 0
    assert prov["config"]["parse_config"]["max_draft_tokens"] == 8 and prov["config"]["n"] == 5


def test_bench_files_agree(bench, tmp_path):
    res, _ = bench
    paths = write_bench(res, tmp_path / "out")
    names = {p.name for p in paths}
    assert names == {"bench.json", "bench.md", "bench_throughput.png", "bench_accuracy.png",
                     "bench_acceptance.png", "bench_rejected_step.png"}  # sd's per position, PARSE's histogram
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    again = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert again["modes"]["parse"]["accuracy"] == res["modes"]["parse"]["accuracy"]
    # every table row of bench.md carries the JSON's numbers, as printed
    md = (tmp_path / "out" / "bench.md").read_text()
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^\| (\S+) \| ([\d.]+) \| ([\d.]+)x \(([\d.]+)-([\d.]+)\) \| ([\d.]+)% \(([\d.]+)-([\d.]+)\) \| ([\d.-]+) \| "
        r"([\d.]+) \|$", md, re.M)}
    assert set(rows) == set(again["modes"])
    for mode, r in again["modes"].items():
        tps, sp, lo, hi, acc, clo, chi, acc_pass, passes = rows[mode]
        assert float(tps) == pytest.approx(r["tokens_per_s"], abs=0.051)
        assert float(sp) == pytest.approx(r["speedup_vs_target"], abs=0.0051)
        assert (float(lo), float(hi)) == pytest.approx((r["speedup_min"], r["speedup_max"]), abs=0.0051)
        assert float(acc) == pytest.approx(100 * r["accuracy"], abs=0.051)
        assert (float(clo), float(chi)) == pytest.approx([100 * x for x in r["accuracy_ci95"]], abs=0.051)
        assert (acc_pass == "-") == (r["accepted_per_pass"] is None)
        assert float(passes) == pytest.approx(r["target_passes_per_100_tokens"], abs=0.051)
    assert again["provenance"]["git_commit"] in md or again["provenance"]["git_commit"][:12] in md


def test_the_report_says_what_auto_ran_and_which_timings_hold_compiles():
    """A parse row that decoded plainly in every repeat timed the target's program: the report says so, summed over
    the timed repeats, and names the modes whose timings include compiling; a fixed run says neither."""
    from parse_jax.harness.bench import run_notes

    rows = {"target": {"schedule_ran": {}, "schedule_ran_each_repeat": [{}, {}], "compiles_in_timing": 0},
            "parse": {"schedule_ran": {"target": 1}, "schedule_ran_each_repeat": [{"target": 1}, {"target": 1}],
                      "compiles_in_timing": 0},
            "sd": {"schedule_ran": {"sd": 1}, "schedule_ran_each_repeat": [{"sd": 1}, {"target": 1}],
                   "compiles_in_timing": 3}}
    ran, compiled = run_notes({"modes": rows})
    assert "parse: target x2; sd: sd x1, target x1." in ran and "target:" not in ran.split("):")[1]
    assert compiled.endswith(": sd 3.")
    assert run_notes({"modes": {m: {**r, "schedule_ran": {}, "schedule_ran_each_repeat": [{}, {}],
                                    "compiles_in_timing": 0} for m, r in rows.items()}}) == []


def test_unknown_mode_is_refused():
    eng = ParseEngine(TARGET, DRAFT)
    with pytest.raises(InputError, match="unknown mode"):
        run_bench(eng, load_task(), RunSettings(n=2, progress=False), modes=["warp"])


def test_modes_follow_the_engine():
    assert set(MODES) <= set(BENCH_MODES) and {"parse-multi", "draft"} <= set(BENCH_MODES)
    assert check_modes(["all"]) == list(BENCH_MODES)
    assert check_modes(["parse", "target", "parse"]) == ["parse", "target"]
    with pytest.raises(InputError, match=r"^modes is empty; give one or more of: target,"):  # --modes ''
        check_modes([])
    cfg = ParseConfig(rounds="multi")
    single = ParseConfig(rounds="single")
    assert mode_config(cfg, "parse") == (single, "parse")  # bench: the label names the rounds
    assert mode_config(ParseConfig(), "parse-multi") == (cfg, "parse")
    assert mode_config(single, "parse-multi") == (cfg, "parse")
    # eval's one mode: rounds set in the config are honoured, "auto" is the label's single round
    assert mode_config(cfg, "parse", honour_rounds=True) == (cfg, "parse")
    assert mode_config(cfg, "parse+eagle3", honour_rounds=True) == (cfg, "parse+eagle3")
    assert mode_config(ParseConfig(), "parse", honour_rounds=True) == (single, "parse")
    assert mode_config(single, "parse-multi", honour_rounds=True) == (cfg, "parse")
    assert mode_config(cfg, "sd") == (cfg, "sd")


def test_unwritable_output_is_refused_before_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InputError, match="cannot write to output folder"):
        check_writable(blocker / "sub")
    with pytest.raises(InputError, match="cannot write"):
        write_json({}, blocker / "x.json")


def test_warm_up_progress_reaches_stderr_before_each_compiling_call(capsys):
    """What compiles (mode, batch shape) and how far the warm-up is show on stderr while it runs, not after."""
    from parse_jax.harness.runs import measure
    from parse_jax.runtime.requests import GenerateResult

    seen = []

    def runner(name):
        def run(prompts, max_new, seed, max_batch=None):
            seen.append((name, len(prompts), capsys.readouterr().err))  # stderr written since the previous call
            return GenerateResult(texts=["7"] * len(prompts), tokens=[[5]] * len(prompts), stats={"target_passes": 2})

        return run

    task = load_task()
    measure({"target": runner("target"), "parse": runner("parse")}, task, task.problems(3, 0),
            RunSettings(n=3, max_new_tokens=4, batch_size=2, repeats=1, seed=0, progress=True, batching="fixed"))
    warm = seen[:4]  # 2 modes x batch shapes {1, 2}
    assert [(n, b) for n, b, _ in warm] == [("target", 1), ("target", 2), ("parse", 1), ("parse", 2)]
    for i, (name, batch, err) in enumerate(warm):
        assert "compiling (warm-up runs)" in err and f"{i}/4" in err, err
        assert f"{name} at batch {batch}" in err and "programs" in err, err
        assert "bench:" not in err  # the timed runs have not started
    assert "4/4" in seen[4][2] and "bench:" in seen[4][2]  # warm-up done, then the timed bar
    assert capsys.readouterr().out == ""  # progress never goes to stdout


def test_each_timed_repeat_records_what_the_schedule_ran():
    """An auto engine may decide differently from one repeat to the next (it measures a contested choice again):
    each repeat's decisions are kept, not only the first's."""
    from parse_jax.harness.runs import measure
    from parse_jax.runtime.requests import GenerateResult

    calls = []

    def auto(prompts, max_new, seed, max_batch=None):
        calls.append(len(prompts))
        ran = "target" if len(calls) % 2 else "parse"  # warm-up: "target"; then parse, target, parse
        choices = [{"ran": ran, "rounds": None if ran == "target" else "single"}]
        return GenerateResult(texts=["7"] * len(prompts), tokens=[[5]] * len(prompts),
                              stats={"target_passes": 1, "schedule": choices})

    def plain(prompts, max_new, seed, max_batch=None):
        return GenerateResult(texts=["7"] * len(prompts), tokens=[[5]] * len(prompts), stats={"target_passes": 1})

    task = load_task()
    rows = measure({"target": plain, "parse": auto}, task, task.problems(2, 0),
                   RunSettings(n=2, max_new_tokens=4, batch_size=2, repeats=3, seed=0, progress=False))
    assert rows["parse"]["schedule_ran_each_repeat"] == [{"parse-single": 1}, {"target": 1}, {"parse-single": 1}]
    assert rows["parse"]["schedule_ran"] == {"parse-single": 1}  # the first repeat's, as the stats it goes with
    assert rows["target"]["schedule_ran_each_repeat"] == [{}, {}, {}]


def test_skipped_modes_are_diagnostics_on_stderr(capsys):
    from parse_jax.utils import progress

    progress.configure(0)
    lines = []
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(max_draft_tokens=4, schedule="fixed"))
    res = run_bench(eng, load_task(), RunSettings(n=1, max_new_tokens=2, batch_size=1, repeats=1, progress=False),
                    modes=["target", "eagle3"], log=lines.append, skip_unavailable=True)
    assert set(res["modes"]) == {"target"} and "eagle3" in res["skipped_modes"]
    captured = capsys.readouterr()
    assert "skipping mode eagle3" in captured.err and "skipping" not in captured.out
    assert not any("skipping" in line for line in lines)  # `log` carries results (the table) only


def test_modes_a_pair_cannot_run_are_skipped_before_data_records_are_checked(tmp_path):
    """--modes all with --data: a mode this pair lacks a head for is skipped as without --data (its check refuses
    every record with a ConfigError, which the records' check must not take for a bad record)."""
    from parse_jax.harness.eval.data import load_records, write_task_jsonl
    from parse_jax.harness.eval.results import DataTask

    data = write_task_jsonl(load_task(), 2, tmp_path / "data.jsonl", seed=1)
    task = DataTask(data, load_records(data, load_task())[0], TARGET.tokenizer, load_task(), chat="off")
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(max_draft_tokens=4, schedule="fixed"))
    res = run_bench(eng, task, RunSettings(n=2, max_new_tokens=2, batch_size=1, repeats=1, progress=False),
                    modes=["target", "eagle3"], log=lambda _: None, skip_unavailable=True)
    assert set(res["modes"]) == {"target"} and "needs an EAGLE-3 head" in res["skipped_modes"]["eagle3"]


def test_warm_up_repeats_while_an_auto_engine_still_compiles_or_explores():
    """A schedule="auto" engine explores, measures and then serves what it measured best, each its own programs:
    the warm-up calls again while a call set anything up (any trace or compile jax reports) or explored (so the
    timed calls meet compiled programs and measured choices), and what still compiles inside the timing is counted.
    (Whether the timed call compiles depends on the times this machine measures, which decide what the engine runs:
    counted, not asserted.)"""
    from parse_jax.harness.runs import WARM_UP_CALLS, measure
    from parse_jax.runtime.programs import compiled_programs, setup_events

    eng = ParseEngine(TARGET, DRAFT, ParseConfig(max_draft_tokens=8, segmenter="stride", stride=3))
    calls = []

    def run(prompts, max_new, seed, max_batch=None):
        before, events = compiled_programs(), setup_events()
        res = eng.generate(prompts, mode="parse", max_new_tokens=max_new, seed=seed, max_batch=max_batch)
        explored = any(c["why"].startswith("exploring") for c in res.stats["schedule"])
        calls.append((setup_events() - events, explored, compiled_programs() - before))
        return res

    task = load_task()
    rows = measure({"target": lambda p, m, s, max_batch=None: eng.generate(p, mode="target", max_new_tokens=m,
                                                                        seed=s, max_batch=max_batch),
                    "parse": run}, task, task.problems(6, 3),
                   RunSettings(n=6, max_new_tokens=8, batch_size=2, repeats=1, seed=0, progress=False))
    warm_ups = calls[:-1]
    # a warm-up call compiled (not always the first: it explores plain decoding, whose served programs the target's
    # runs, or earlier tests in this process, may have set up already)
    assert any(setup > 0 and compiled > 0 for setup, _, compiled in warm_ups)
    assert all(setup or explored for setup, explored, _ in warm_ups[:-1])  # each called again for a reason
    assert len(warm_ups) == WARM_UP_CALLS or warm_ups[-1][:2] == (0, False)  # until one set up and explored nothing
    assert rows["parse"]["compiles_in_timing"] == calls[-1][2]
