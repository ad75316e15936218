"""parse-jax as an lm-evaluation-harness model: registered as "parse-jax", generate_until through the engine (its
`until` and `max_gen_toks` honoured), loglikelihood(_rolling) on the target, speculation stats beside lm-eval's
results; the shipped embedded-task YAML over a local JSONL file gives `parse-jax eval`'s accuracy."""

import json
import re

import numpy as np
import pytest
import yaml

lm_eval = pytest.importorskip("lm_eval")  # the test extra installs it; without it this module cannot run

from lm_eval.api.instance import Instance  # noqa: E402

from parse_jax import ParseConfig, evaluate, load_pair  # noqa: E402
from parse_jax.checkpoints.pair import PAIR_DIR  # noqa: E402
from parse_jax.harness import lm_eval_model  # noqa: E402  (registers "parse-jax")
from parse_jax.harness.eval.data import write_task_jsonl  # noqa: E402
from parse_jax.harness.lm_eval_args import DEFAULT_BATCH  # noqa: E402
from parse_jax.tasks import load_task  # noqa: E402
from parse_jax.utils.paths import config_dir  # noqa: E402


def _task(data) -> dict:
    task = yaml.safe_load((config_dir() / "lm_eval" / "parse_jax_embedded.yaml").read_text())
    task["dataset_kwargs"] = {"data_files": {"test": str(data)}}
    return task


def test_simple_evaluate_on_the_embedded_task_equals_parse_jax_eval(tmp_path):
    data = write_task_jsonl(load_task(), 12, tmp_path / "problems.jsonl", seed=11)
    stats = tmp_path / "stats.json"
    fixed = {"schedule": "fixed"}  # PARSE in both (auto may decode plainly on other batch sizes: other texts)
    out = lm_eval.simple_evaluate(model="parse-jax", model_args={"mode": "parse", "batch_size": 4,
                                                                 "stats_path": str(stats),
                                                                 "parse_config": json.dumps(fixed)},
                                  tasks=[_task(data)], log_samples=True)
    acc = out["results"]["parse_jax_embedded"]["exact_match,final_answer"]
    target, draft = load_pair()
    ours = evaluate(target, draft, data, mode="parse", batch_size=4, max_new_tokens=64,
                    config=ParseConfig.load(fixed))
    assert acc == pytest.approx(ours.accuracy) and 0 < ours.accuracy
    got = {s["doc"]["prompt"]: s["resps"][0][0] for s in out["samples"]["parse_jax_embedded"]}
    assert got == {json.loads(x)["prompt"]: r["output"] for x, r in zip(data.read_text().splitlines(),
                                                                         ours.records)}
    written = json.loads(stats.read_text())
    assert written == out["config"]["speculation_stats"] and written["mode"] == "parse"
    assert written["num_verifications"] >= 12 and written["accepted_tokens"] == sum(
        r["accepted_tokens"] for r in ours.records)


def test_until_and_max_gen_toks_and_the_target_scores():
    lm = lm_eval_model.ParseJaxLM(mode="sd", batch_size=2)
    prompt = load_task().problems(1, 3)[0][0]
    full = lm.generate_until([Instance("generate_until", {}, (prompt, {"max_gen_toks": 24, "until": []}), 0)])[0]
    assert ";" in full
    cut, short = lm.generate_until([
        Instance("generate_until", {}, (prompt, {"max_gen_toks": 24, "until": [";"]}), 0),
        Instance("generate_until", {}, (prompt, {"max_gen_toks": 2, "until": []}), 1)])
    assert cut == full[: full.index(";")]
    assert len(lm.target.tokenizer.encode(short)) <= 2 and full.startswith(short.strip())
    tok, target = lm.target.tokenizer, lm.target
    text = tok.decode(tok.encode(" " + full)[:5])  # the first 5 tokens of the answer
    ctx, cont = lm_eval_model.encode_pair(tok, prompt, text)  # split as lm-eval splits it (checked against lm-eval)
    assert ctx[0] == tok.bos_id  # the embedded tokenizer's post-processor writes its BOS
    logits = np.asarray(target.logits(np.array([ctx + cont])), np.float64)[0]
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    expect = sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont))
    (_, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (prompt, " " + full), 0)])
    assert greedy  # sd's greedy output is the target's own greedy continuation
    (ll5, _), = lm.loglikelihood([Instance("loglikelihood", {}, (prompt, text), 0)])
    assert ll5 == pytest.approx(expect, abs=1e-4)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (prompt,), 0)])
    ids = tok.encode_prompt(prompt)  # as lm-eval's HF model: the document's own BOS predicted after the prefix BOS
    logits = np.asarray(target.logits(np.array([[tok.bos_id] + ids])), np.float64)[0]
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    assert rolling == pytest.approx(sum(logp[i, t] for i, t in enumerate(ids)), abs=1e-4)


def test_documents_and_contexts_longer_than_the_target_are_scored_as_lm_evals_hf_model_scores():
    """loglikelihood_rolling over a document longer than the target's positions runs in windows of max_length + 1
    tokens (the last one never fed); a context longer than the positions is cut from the left; an empty
    continuation scores 0 and is greedy."""
    lm = lm_eval_model.ParseJaxLM(mode="target", batch_size=1)
    tok, target = lm.target.tokenizer, lm.target
    width = target.config.max_position_embeddings
    prompt = load_task().problems(1, 3)[0][0]
    doc = " ".join([prompt] * (2 * width // len(tok.encode(prompt)) + 1))
    assert len(tok.encode(doc)) > width
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (doc,), 0)])
    assert np.isfinite(rolling) and rolling < 0
    cont = tok.encode(" 3")
    ((ll, _),) = lm.loglikelihood([Instance("loglikelihood", {}, (doc, " 3"), 0)])
    fed = ([tok.bos_id] + tok.encode(doc) + cont)[-(width + 1):][:-1]  # the context's last tokens
    logits = np.asarray(target.logits(np.array([fed])), np.float64)[0, -len(cont):]
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    assert ll == pytest.approx(sum(logp[i, t] for i, t in enumerate(cont)), abs=1e-4)
    assert lm.loglikelihood([Instance("loglikelihood", {}, (prompt, ""), 0)]) == [(0.0, True)]


def test_sampling_kwargs_are_honoured_as_lm_evals_hf_model_reads_them():
    """do_sample with a temperature samples (the lm's seed: the same call twice gives the same text, unlike greedy);
    do_sample false is greedy whatever the temperature; top_k / top_p are refused, not ignored."""
    lm = lm_eval_model.ParseJaxLM(mode="target", batch_size=2)
    prompts = [p for p, _ in load_task().problems(2, 5)]

    def run(**kw):
        return lm.generate_until([Instance("generate_until", {}, (p, {"max_gen_toks": 16, "until": [], **kw}), i)
                                  for i, p in enumerate(prompts)])

    greedy = run()
    assert run(do_sample=False, temperature=5.0) == greedy == run(temperature=0.0) == run(top_p=0.9)
    hot = run(do_sample=True, temperature=5.0)
    assert hot != greedy and run(do_sample=True, temperature=5.0) == hot
    with pytest.raises(lm_eval_model.ConfigError, match="top_k=40 is not supported"):
        run(do_sample=True, top_k=40)
    # lm-eval's repeats: the same request in batches of their own draws its own sample
    one = lm_eval_model.ParseJaxLM(mode="target", batch_size=1)
    twice = one.generate_until([Instance("generate_until", {}, (prompts[0], {"max_gen_toks": 16, "until": [],
                                                                          "do_sample": True, "temperature": 5.0}), i)
                                for i in range(2)])
    assert twice[0] != twice[1]


def _gen(lm, prompts, until, max_gen_toks=64):
    """(outputs, the stats of this call alone) of generate_until on `prompts` with `until`."""
    before = len(lm.stats_parts)
    out = lm.generate_until([Instance("generate_until", {}, (p, {"max_gen_toks": max_gen_toks, "until": until}), i)
                             for i, p in enumerate(prompts)])
    parts = lm.stats_parts[before:]
    return out, {k: sum(p[k] for p in parts) for k in ("new_tokens", "target_passes")}


@pytest.mark.parametrize("mode", ["target", "sd", "parse"])
def test_a_stop_string_ends_its_row_and_the_output_is_lm_evals_cut(mode):
    from lm_eval.models.utils import postprocess_generated_text

    lm = lm_eval_model.ParseJaxLM(mode=mode, batch_size=4, parse_config='{"schedule": "fixed"}')
    prompts = [p for p, _ in load_task().problems(3, 5)]
    full, uncut = _gen(lm, prompts, [])
    assert all(t.count(";") >= 2 for t in full)
    single = ";"  # one token of the embedded tokenizer: a stop id inside the device program
    assert lm_eval_model.single_token_stops(lm.target.tokenizer, (single,)) != ()
    out, stats = _gen(lm, prompts, [single])
    assert out == [postprocess_generated_text(t, [single], None) for t in full]
    assert stats["new_tokens"] < uncut["new_tokens"] / 2
    if mode == "parse":  # one verification pass either way here; a batch runs in one call (no segments)
        assert stats["target_passes"] <= uncut["target_passes"]
        return
    assert stats["target_passes"] < uncut["target_passes"]
    multi = full[0].split(";")[0].split("=")[0][-2:] + "= "  # e.g. "9 = ": two tokens and a space, in row 0 only
    assert lm_eval_model.single_token_stops(lm.target.tokenizer, (multi,)) == ()
    out, stats = _gen(lm, prompts, [multi, "never"])
    assert out == [postprocess_generated_text(t, [multi, "never"], None) for t in full]
    assert out[0] != full[0] and stats["new_tokens"] < uncut["new_tokens"]


def test_the_entry_point_names_the_registered_model():
    """pyproject's `lm_eval.models` entry point (the group lm-eval's plugin discovery reads) loads the class that
    `register_model("parse-jax")` put in lm-eval's registry."""
    import tomllib
    from importlib.metadata import EntryPoint
    from pathlib import Path

    from lm_eval.api.registry import get_model

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    (name, value), = project["entry-points"]["lm_eval.models"].items()
    cls = EntryPoint(name=name, value=value, group="lm_eval.models").load()
    assert name == "parse-jax" and cls is lm_eval_model.ParseJaxLM is get_model(name)
    assert project["scripts"]["parse-jax-lm-eval"] == "parse_jax.harness.lm_eval_model:main"


@pytest.mark.subprocess
def test_lm_evals_command_line_on_the_shipped_task_offline(tmp_path):
    """`parse-jax-lm-eval run ...` (lm-eval's own CLI, parse-jax registered) on the shipped task YAML over a local
    JSONL file, with the hub off: lm-eval's results file holds the score and the speculation stats."""
    import os
    import subprocess
    import sys

    write_task_jsonl(load_task(), 4, tmp_path / "problems.jsonl", seed=5)  # the YAML's data_files, from the cwd
    stats = tmp_path / "spec.json"
    # sd as configured: under the default schedule="auto" this machine's costs may pick plain decoding (no drafts)
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps({"schedule": "fixed"}))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-c", "from parse_jax.harness.lm_eval_model import main; main()", "run",
           "--model", "parse-jax", "--model_args", f"mode=sd,batch_size=4,stats_path={stats},parse_config={fixed}",
           "--tasks", "parse_jax_embedded", "--include_path", str(config_dir() / "lm_eval"),
           "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "out").rglob("results_*.json")
    out = json.loads(path.read_text())
    assert out["results"]["parse_jax_embedded"]["exact_match,final_answer"] >= 0.5  # sd: the target's own answers
    assert out["config"]["model"] == "parse-jax" and out["config"]["speculation_stats"]["num_drafts"] >= 4
    assert json.loads(stats.read_text()) == out["config"]["speculation_stats"]


def test_bad_model_args_are_one_line_from_the_entry_point(tmp_path, monkeypatch, capsys):
    """`parse-jax-lm-eval run --model_args mode=bogus`: one line naming the value, exit 2, no traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_task_jsonl(load_task(), 2, tmp_path / "problems.jsonl", seed=5)
    monkeypatch.setattr("sys.argv", ["parse-jax-lm-eval", "run", "--model", "parse-jax", "--model_args", "mode=bogus",
                                     "--tasks", "parse_jax_embedded", "--include_path", str(config_dir() / "lm_eval"),
                                     "--limit", "1"])
    with pytest.raises(SystemExit) as stop:
        lm_eval_model.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("parse-jax-lm-eval: error:")]
    assert "bogus" in line


def test_stop_strings_of_one_token_special_ones_included(tmp_path):
    """A chat turn's end (`<|im_end|>`, a special token) and a one-token word are stop ids; text that spans tokens
    is not; `until` as lm-eval gives it (a string, a list, None) is read as its non-empty stop strings."""
    from parse_jax import load_model
    from tests.models.hf_tiny import make_tiny_hf

    tok = load_model(make_tiny_hf("qwen3", tmp_path / "q", seed=3, tokenizer="qwen")).tokenizer
    end = tok.encode("<|im_end|>")
    assert len(end) == 1 and lm_eval_model.single_token_stops(tok, ("<|im_end|>",)) == (end[0],)
    long = "<|im_end|>\n<|im_start|>user"
    assert len(tok.encode(long)) > 1 and lm_eval_model.single_token_stops(tok, (long,)) == ()
    assert lm_eval_model.stop_strings("\n\n") == ("\n\n",) and lm_eval_model.stop_strings(None) == ()
    assert lm_eval_model.stop_strings(["", "Q:"]) == ("Q:",)
    with pytest.raises(lm_eval_model.ConfigError, match="until must be a string or a list of strings"):
        lm_eval_model.stop_strings([3])


def test_each_generation_group_is_one_job(tmp_path, monkeypatch):
    """lm-eval hands the model every request at once: each group (one budget and stop set) is declared a job, as
    `parse-jax eval` declares its records, so under schedule="auto" a choice's program setup is charged to the
    group's rows. With sd's setup on record as far more than those rows could pay back, the group decodes plainly,
    and the speculation stats say what ran."""
    from parse_jax.schedule.setup import load_setup_costs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the profiles folder (and the setup file) of this test
    stats = tmp_path / "stats.json"
    lm = lm_eval_model.ParseJaxLM(mode="sd", batch_size=2, stats_path=str(stats))
    load_setup_costs(lm.target, lm.draft, lm.target.eagle3).with_figure("sd", 2, 1e6).with_figure(
        "target", 2, 0.0).save()
    prompts = [p for p, _ in load_task().problems(4, 5)]
    lm.generate_until([Instance("generate_until", {}, (p, {"max_gen_toks": 16, "until": []}), i)
                       for i, p in enumerate(prompts)])
    decisions = [c for part in lm.stats_parts for c in part["schedule"]]
    assert decisions and {c["ran"] for c in decisions} == {"target"}
    assert all(c["setup_seconds_per_token"]["sd"] > 1e3 for c in decisions)  # charged: a job was declared
    # the stats written say so: every request decoded plainly, not in sd (as `parse-jax eval`'s schedule_ran)
    assert json.loads(stats.read_text())["schedule_ran"] == {"target": len(prompts)}
    assert lm.get_model_info()["speculation_stats"]["schedule_ran"] == {"target": len(prompts)}


def test_generation_kwargs_and_batch_sizes_as_lm_eval_names_them(tmp_path, monkeypatch, caplog):
    """The budget under any of lm-eval's names, in its priority; kwargs that would change the output and cannot be
    honoured are refused, unknown ones warned about and the output unchanged; `auto` batch sizes are parse-jax's
    default under `max_batch_size`; a `stats_path` that cannot be written is refused before the run."""
    from parse_jax.utils.progress import logger

    monkeypatch.setattr(logger, "propagate", True)  # the CLI's configure() may have turned it off in this process
    assert lm_eval_model.ParseJaxLM(mode="target", batch_size="auto:4").batch_size == DEFAULT_BATCH
    assert lm_eval_model.ParseJaxLM(mode="target", batch_size=3, max_batch_size=2).batch_size == 3  # auto's cap
    lm = lm_eval_model.ParseJaxLM(mode="target", batch_size="auto", max_batch_size=2)
    assert lm.batch_size == 2
    prompt = load_task().problems(1, 7)[0][0]

    def run(**kw):
        return lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], **kw}), 0)])[0]

    three = run(max_gen_toks=3)
    assert run(max_new_tokens=3, max_tokens=40) == three == run(max_completion_tokens=3)
    assert run(max_gen_toks=3, max_new_tokens=40) == three and len(run(max_tokens=12)) > len(three)
    with caplog.at_level("WARNING", logger="parse_jax"):
        assert run(max_gen_toks=3, frobnicate=1) == three
    assert "ignoring generation kwargs the parse-jax model does not read: frobnicate" in caplog.text
    with pytest.raises(lm_eval_model.ConfigError, match="num_beams=4 is not supported"):
        run(max_gen_toks=3, num_beams=4)
    with pytest.raises(lm_eval_model.ConfigError, match="max_new_tokens must be >= 1, got 0"):
        run(max_new_tokens=0)
    with pytest.raises(lm_eval_model.ConfigError, match=r"batch_size \(a number, auto or auto:N\) must be an "
                                                        r"integer, got 'big'"):
        lm_eval_model.ParseJaxLM(mode="target", batch_size="big")
    with pytest.raises(lm_eval_model.InputError, match="it is a folder"):
        lm_eval_model.ParseJaxLM(mode="target", stats_path=str(tmp_path))


def test_chat_history_is_rendered_as_transformers_renders_it(tmp_path):
    """`--apply_chat_template`: lm-eval's chat history through the target's own template, equal to transformers'
    rendering of the same folder (a generation prompt, or the final assistant message left open); a target
    without a template is refused at the flag; a task runs end to end with it."""
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_tiny import make_tiny_hf

    folder = make_tiny_hf("qwen3", tmp_path / "q", seed=4, tokenizer="qwen")
    lm = lm_eval_model.ParseJaxLM(target=str(folder), mode="target", enable_thinking=False, batch_size=2)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    history = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "add 3 and 4"},
               {"role": "assistant", "content": "7"}, {"role": "user", "content": "and 5 and 6?"}]
    assert lm.apply_chat_template(history) == hf.apply_chat_template(
        history, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    for prefill in ("The sum is", "Answer: "):  # a trailing space is kept where the template keeps it
        open_turn = [*history, {"role": "assistant", "content": prefill}]
        assert lm.apply_chat_template(open_turn, add_generation_prompt=False) == hf.apply_chat_template(
            open_turn, tokenize=False, add_generation_prompt=False, continue_final_message=True,
            enable_thinking=False)
    assert lm.chat_template(True) == hf.chat_template and lm.chat_template(False) is None
    assert "/" not in lm.tokenizer_name
    with pytest.raises(lm_eval_model.ConfigError, match="--apply_chat_template: the target's tokenizer .* has no "
                                                        "chat template"):
        lm_eval_model.ParseJaxLM(mode="target").chat_template(True)
    data = write_task_jsonl(load_task(), 2, tmp_path / "problems.jsonl", seed=13)
    task = _task(data)
    task["generation_kwargs"]["max_gen_toks"] = 8
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], apply_chat_template=True, log_samples=True)
    (sample, _) = out["samples"]["parse_jax_embedded"]
    assert sample["arguments"][0][0].startswith("<|im_start|>user")


def _their_hf_model(folder, max_length: int):
    """lm-eval's own HF model (`HFLM`) with transformers' tokenizer of `folder` and no torch model: its
    `_loglikelihood_tokens` (the forward passes) records the ids it would score instead."""
    from lm_eval.api.model import CacheHook
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    hf = HFLM.__new__(HFLM)  # its __init__ loads a torch model; the tokenization reads only these
    hf.tokenizer = AutoTokenizer.from_pretrained(folder)
    hf.add_bos_token, hf.custom_prefix_token_id, hf.backend, hf._max_length = None, None, "causal", max_length
    hf.enable_thinking = None
    hf.batch_size_per_gpu, hf._rank, hf._world_size, hf.cache_hook = 1, 0, 1, CacheHook(None)
    hf.scored = []

    def forward(requests, **_):
        hf.scored += [(list(context), list(continuation)) for _, context, continuation in requests]
        return [(0.0, True)] * len(requests)

    hf._loglikelihood_tokens = forward
    return hf


@pytest.mark.parametrize("tokenizer", ["embedded", "qwen"])
def test_scoring_requests_are_tokenized_as_lm_evals_hf_model_tokenizes_them(tokenizer, tmp_path, monkeypatch):
    """The ids each loglikelihood(_rolling) request is scored on equal those lm-eval's own HF model (`HFLM`) scores,
    with transformers' tokenizer of the same folder: trailing spaces moved into the continuation, the tokenizer's
    own special tokens (the embedded one's post-processor adds its BOS; Qwen's adds none and names no BOS, so its
    EOS is the prefix token), an empty context as the prefix token, rolling windows after it."""
    from tests.models.hf_tiny import make_tiny_hf

    folder = (make_tiny_hf("qwen3", tmp_path / "q", seed=3, tokenizer="qwen") if tokenizer == "qwen"
              else PAIR_DIR / "target")
    lm = lm_eval_model.ParseJaxLM(target=str(folder), mode="target", batch_size=1)
    width = lm.target.config.max_position_embeddings
    hf = _their_hf_model(folder, width)
    scored = []
    monkeypatch.setattr(lm, "_score", lambda context, continuation, index: scored.append(
        (context, continuation)) or (0.0, True))
    prompt = load_task().problems(1, 9)[0][0]
    pairs = [(prompt, " 3;"), (prompt + " ", "3;"), (prompt + "  ", " 3"), ("x = 1", "2;"), (prompt[:-2], prompt[-2:]),
             ("", prompt), ("", " 3")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    lm.loglikelihood(requests)
    hf.loglikelihood(requests)
    assert scored == hf.scored and len(scored) == len(pairs)
    scored.clear()
    hf.scored.clear()
    long_doc = " ".join([prompt] * (2 * width // len(lm.target.tokenizer.encode(prompt)) + 1))
    documents = [Instance("loglikelihood_rolling", {}, (doc,), i) for i, doc in enumerate([prompt, long_doc])]
    lm.loglikelihood_rolling(documents)
    hf.loglikelihood_rolling(documents)
    assert scored == hf.scored and len(scored) > 2  # the long document in several windows


def test_a_context_of_spaces_and_a_tokenizer_without_bos_or_eos(tmp_path, monkeypatch):
    """A context of spaces alone moves into the continuation and, on Qwen's tokenizer (no BOS added), leaves no
    ids: it is scored after the prefix token, as an empty context is. A tokenizer naming neither BOS nor EOS has no
    prefix token: the requests that need one are refused in one line naming the request."""
    from parse_jax.errors import InputError
    from tests.models.hf_tiny import make_tiny_hf

    folder = make_tiny_hf("qwen3", tmp_path / "q", seed=3, tokenizer="qwen")
    lm = lm_eval_model.ParseJaxLM(target=str(folder), mode="target", batch_size=1)
    tok = lm.target.tokenizer
    assert tok.bos_id is None and tok.eos_id is not None
    assert lm_eval_model.encode_pair(tok, "  ", "3", tok.eos_id) == ([tok.eos_id], tok.encode("  3"))
    ((spaces, _), (empty, _)) = lm.loglikelihood([Instance("loglikelihood", {}, ("  ", "3"), 0),
                                                  Instance("loglikelihood", {}, ("", "  3"), 1)])
    assert spaces == empty and np.isfinite(spaces)
    monkeypatch.setattr(tok, "eos_id", None)
    with pytest.raises(InputError, match=r"^loglikelihood: request 1: an empty context: needs a token to condition "
                                         r"on and the target's tokenizer names no BOS or EOS"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("x =", " 3"), 0), Instance("loglikelihood", {}, ("", "3"), 1)])
    with pytest.raises(InputError, match=r"^loglikelihood_rolling: needs a token to condition on"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("x = 3",), 0)])


def test_a_context_whose_chat_template_wrote_the_bos_is_scored_after_one_bos(tmp_path):
    """loglikelihood on a context rendered by a template that writes `{{ bos_token }}` (Llama-3's): one BOS in front,
    as lm-eval's HF model scores it, not the template's and ours."""
    from tests.models.hf_tiny import make_tiny_hf

    folder = make_tiny_hf("llama3", tmp_path / "l", seed=5)
    lm = lm_eval_model.ParseJaxLM(target=str(folder), mode="target", batch_size=1)
    tok, target = lm.target.tokenizer, lm.target
    context = lm.apply_chat_template([{"role": "user", "content": "add 3 and 4"}])
    ctx, cont = lm_eval_model.encode_pair(tok, context, " 7")  # lm-eval's split (a template's newline moves on)
    assert ctx[0] == tok.bos_id and ctx[1] != tok.bos_id
    logits = np.asarray(target.logits(np.array([ctx + cont])), np.float64)[0]
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    expect = sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont))
    ((ll, _),) = lm.loglikelihood([Instance("loglikelihood", {}, (context, " 7"), 0)])
    assert ll == pytest.approx(expect, abs=1e-4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Training runs (Orbax CheckpointManager folders, as this project's trainer lays them out) of the engine tests'
    target and draft."""
    from tests.checkpoints.runs_fixture import write_run
    from tests.test_engine import DRAFT, TARGET

    root = tmp_path_factory.mktemp("runs")
    saved = write_run(root / "target_run", TARGET, steps=(4, 10), run_json=True)
    write_run(root / "draft_run", DRAFT, steps=(30,), run_json=True)
    return root / "target_run", root / "draft_run", saved


def test_model_args_choose_a_step_of_a_training_run_and_the_results_say_which(runs):
    """`step` / `draft_step` (and `params_path`, `config_from`: `load_model`'s) pick a step of a run: the params of
    that step are the ones loaded, and lm-eval's reported config names the path and the step read (the latest where
    none is given), as `parse-jax eval`'s provenance does (`target_step`). Misplaced or missing ones: one line."""
    import jax

    target_run, draft_run, saved = runs
    lm = lm_eval_model.ParseJaxLM.create_from_arg_string(
        f"target={target_run},step=4,params_path=state/params,draft={draft_run},mode=sd,batch_size=1")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lm.target.params), jax.tree.leaves(saved[4])))
    models = lm.get_model_info()["parse_jax_models"]
    assert models["target"] == str(target_run.resolve()) and models["draft"] == str(draft_run.resolve())
    assert models["target_step"] == 4 and models["draft_step"] == 30 and models["target_params_path"] == "state/params"
    latest = lm_eval_model.ParseJaxLM(target=str(target_run), mode="target", batch_size=1, config_from=str(target_run))
    assert latest.get_model_info()["parse_jax_models"]["target_step"] == 10
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(latest.target.params),
                                                    jax.tree.leaves(saved[10])))
    cases = [(dict(draft_step=3), "model_args draft_step: only with draft=RUN_DIR"),
             (dict(target=str(target_run), step=15), "model_args target: step 15 not found in "),
             (dict(target=str(target_run), draft=str(draft_run), draft_step=998, mode="sd"),
              "model_args draft: step 998 not found in "),
             (dict(target=str(target_run), step="four"), "step must be an integer, got 'four'"),
             (dict(target=str(target_run), draft=str(draft_run), draft_params_path="state/x", mode="sd"),
              "model_args draft: params_path 'state/x' not found")]
    for args, message in cases:
        with pytest.raises(lm_eval_model.ParseJaxError, match=re.escape(message)):
            lm_eval_model.ParseJaxLM(**{"mode": "target", **args})


def test_a_context_longer_than_the_mode_holds_is_cut_from_the_left_with_one_warning(monkeypatch, caplog):
    """As lm-eval's HF model cuts a context to `max_length - max_gen_toks`: a context longer than the mode holds
    with its budget keeps its last tokens (in target mode exactly max_length - max_gen_toks; in sd the longest the
    engine takes, its draft's room counted), one warning says how many were cut, and the rest run as before."""
    from parse_jax import ParseEngine, generate
    from parse_jax.runtime.requests import encode_prompts
    from parse_jax.utils.progress import logger

    monkeypatch.setattr(logger, "propagate", True)
    prompt = load_task().problems(1, 3)[0][0]
    long = " ".join(["1 + 2 ;"] * 200)
    reqs = [Instance("generate_until", {}, (p, {"max_gen_toks": 16, "until": []}), i)
            for i, p in enumerate([prompt, long, prompt])]
    for mode in ("target", "sd"):
        lm = lm_eval_model.ParseJaxLM(mode=mode, batch_size=2, parse_config='{"schedule": "fixed"}')
        width = lm.target.config.max_position_embeddings
        ids = encode_prompts(lm.target, [long])[0]
        assert len(ids) + 16 > width
        caplog.clear()
        with caplog.at_level("WARNING", logger="parse_jax"):
            out = lm.generate_until(reqs)
        (line,) = [r.getMessage() for r in caplog.records if "cut from the left" in r.getMessage()]
        kept = int(re.search(r"to the last (\d+) tokens", line).group(1))
        assert line.startswith("generate_until: 1 of 3 requests") and "(requests 1)" in line
        if mode == "target":
            assert kept == width - 16
        else:  # the longest the engine's own request takes: one token more is refused
            eng = ParseEngine(lm.target, lm.draft, lm.config)
            eng.request([ids[-kept:]], "sd", 16, 0.0, 0, 0, 1.0, None)
            with pytest.raises(lm_eval_model.InputError):
                eng.request([ids[-kept - 1:]], "sd", 16, 0.0, 0, 0, 1.0, None)
        expect = generate(lm.target, [ids[-kept:], encode_prompts(lm.target, [prompt])[0]], max_new_tokens=16).texts
        assert out == [expect[1], expect[0], expect[1]]  # greedy sd writes the target's own tokens


def test_an_error_of_a_batch_names_the_request_not_the_row():
    """An error raised on a batch names the request's index in the lm-eval call, not its row in the batch."""
    lm = lm_eval_model.ParseJaxLM(mode="target", batch_size=2)
    prompt = load_task().problems(1, 3)[0][0]
    reqs = [Instance("generate_until", {}, (p, {"max_gen_toks": n, "until": []}), i)
            for i, (p, n) in enumerate([(prompt, 16), (prompt, 8), ("   ", 8)])]
    with pytest.raises(lm_eval_model.InputError, match=r"^generate_until: request 2 is empty") as err:
        lm.generate_until(reqs)
    assert "prompt" not in str(err.value)
    width = lm.target.config.max_position_embeddings
    with pytest.raises(lm_eval_model.InputError, match=rf"request 1 asks for max_gen_toks={width}, which leaves no "
                                                       "room for a context in mode target"):
        lm.generate_until([reqs[0], Instance("generate_until", {}, (prompt, {"max_gen_toks": width}), 1)])


def test_stats_path_is_written_by_scoring_runs_too(tmp_path):
    """A run of loglikelihood requests only writes `stats_path` (what lm-eval's results hold too): no generation,
    and how many requests were scored on the target."""
    stats = tmp_path / "stats.json"
    lm = lm_eval_model.ParseJaxLM(mode="parse", batch_size=1, stats_path=str(stats))
    prompt = load_task().problems(1, 3)[0][0]
    lm.loglikelihood([Instance("loglikelihood", {}, (prompt, " 3"), 0),
                      Instance("loglikelihood", {}, (prompt, " 4"), 1)])
    assert json.loads(stats.read_text()) == lm.get_model_info()["speculation_stats"]
    assert json.loads(stats.read_text()) == {"mode": "parse", "batches": 0, "scored_requests": 2}
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (prompt,), 0)])
    assert json.loads(stats.read_text())["scored_requests"] == 3


def test_inline_json_parse_config_in_a_model_args_string():
    """`create_from_arg_string` splits at commas outside braces, brackets and quotes: an inline-JSON parse_config
    with several keys is one value (lm-eval's own split cuts it at its first comma)."""
    given = '{"schedule": "fixed", "threshold": 0.3, "max_draft_tokens": 12}'
    lm = lm_eval_model.ParseJaxLM.create_from_arg_string(f"mode=target,parse_config={given},batch_size=3")
    assert lm.config == ParseConfig.load(given) != ParseConfig() and lm.batch_size == 3
    assert lm_eval_model.parse_args_string('a="x,y",b=[1, 2],c=true,d=it\'s') == {"a": "x,y", "b": "[1, 2]",
                                                                                  "c": True, "d": "it's"}
    with pytest.raises(lm_eval_model.ConfigError, match=r"model_args 'mode=target,parse_config=\{': unbalanced"):
        lm_eval_model.ParseJaxLM.create_from_arg_string("mode=target,parse_config={")
