"""`train-eagle3 --data`: an EAGLE-3 head for any HF target from a JSONL file: the loss falls, a killed run
resumes, the head (with a draft vocabulary chosen by frequency) loads in both layouts and drafts losslessly."""

import json

import numpy as np
import pytest

import parse_jax as pj
from parse_jax.errors import InputError
from parse_jax.runtime.decode import generate
from parse_jax.speculation.eagle3 import eagle3_generate
from parse_jax.train.eagle3_data import data_taps, draft_vocabulary, read_records, train_eagle3_data
from parse_jax.train.recipe import Eagle3Spec
from parse_jax.train.trainer import PhaseOptions, latest_step

SPEC = Eagle3Spec(steps=30, batch_size=8, lr=1e-2, warmup_steps=2, unroll=2, samples=48, seq_len=32,
                  checkpoint_every=10, draft_vocab_size=60)


@pytest.fixture(scope="module")
def hf_target(tiny_hf):
    return pj.load_model(tiny_hf("qwen3", seed=4))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory, hf_target):
    """Half {prompt, response}, half chat messages; responses the target's own greedy continuations (so there
    is something a head can learn from a random target: its argmax is deterministic)."""
    from tests.models.hf_tiny import step_corpus

    texts = step_corpus(48, seed=1)
    prompts = [t[:12] for t in texts]
    outs = generate(hf_target, prompts, max_new_tokens=16).texts
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = []
    for i, (p, r) in enumerate(zip(prompts, outs)):
        rec = ({"prompt": p, "response": r} if i % 2 else
               {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]})
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_taps_are_distinct_layers():
    assert data_taps(32) == (2, 16, 29) and data_taps(8) == (2, 4, 5)
    for n in range(1, 12):
        taps = data_taps(n)
        assert len(set(taps)) == len(taps) >= 2 and all(0 <= t <= n for t in taps), (n, taps)


def test_draft_vocabulary_is_the_most_frequent_response_tokens():
    rows = np.zeros((2, 8), np.int32)  # 6 token columns, then prompt length and row length
    rows[0, :6], rows[0, 6:] = [9, 9, 5, 5, 5, 7], [2, 6]  # response 5 5 5 7
    rows[1, :6], rows[1, 6:] = [5, 3, 3, 1, 0, 0], [1, 4]  # response 3 3 1 (then padding)
    assert draft_vocabulary(rows, 3, 10).tolist() == [1, 3, 5]  # 5 x3, 3 x2, then 1 and 7 once: ties by id
    assert draft_vocabulary(rows, 6, 10).tolist() == [0, 1, 2, 3, 5, 7]  # padded with the lowest unused ids


def test_bad_records_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: field 'messages'"):
        read_records(bad, need_response=True)
    bad.write_text('{"prompt": "a"}\n')
    with pytest.raises(InputError, match="--regenerate"):
        read_records(bad, need_response=True)
    assert read_records(bad, need_response=False) == [{"prompt": "a", "response": None, "where": f"{bad}:1"}]


def test_a_record_the_chat_template_refuses_names_its_line_and_a_draft_vocabulary_must_fit(hf_target, tmp_path):
    """Every bad record names its line, one the target's chat template refuses (a role it does not know) too; a
    draft vocabulary larger than the target's is refused before any record is read, not silently the full one."""
    from parse_jax.errors import ConfigError

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n"
                    + json.dumps({"messages": [{"role": "tool", "content": "x"},
                                               {"role": "assistant", "content": "y"}]}) + "\n")
    spec = Eagle3Spec(samples=4, seq_len=24, steps=1, batch_size=2)
    with pytest.raises(InputError, match=r"chat.jsonl:2: chat template refused the messages: unknown role tool"):
        train_eagle3_data(hf_target, data, tmp_path / "run", spec)
    vocab = hf_target.config.vocab_size
    with pytest.raises(ConfigError, match=rf"--draft-vocab-size\) {vocab + 1} is above the target's vocabulary of "
                                          rf"{vocab}; allowed 0 \(the full vocabulary\) to {vocab}"):
        train_eagle3_data(hf_target, data, tmp_path / "run2", Eagle3Spec(draft_vocab_size=vocab + 1))
    assert not (tmp_path / "run2").exists()


def test_responses_as_given_follow_the_prompt(hf_target, data_file, tmp_path):
    from parse_jax.runtime.requests import encode_prompts
    from parse_jax.train.eagle3_data import prepare

    spec = Eagle3Spec(samples=4, seq_len=40, draft_vocab_size=0)
    rows, ids = prepare(hf_target, data_file, spec, tmp_path, False, False)
    rec = read_records(data_file, True)[1]  # a {prompt, response} record
    tok = hf_target.tokenizer
    want = encode_prompts(hf_target, [rec["prompt"]])[0] + tok.encode(rec["response"]) + [tok.eos_id]
    assert ids is None and rows[1, -2] == len(want) - len(tok.encode(rec["response"])) - 1
    assert rows[1, : rows[1, -1]].tolist() == want[:40]
    chat = read_records(data_file, True)[0]  # chat messages: the template up to the assistant's turn
    prompt = tok.encode(tok.apply_chat_template(chat["messages"], add_generation_prompt=True))
    assert rows[0, : rows[0, -2]].tolist() == prompt


def test_records_longer_than_a_row_are_reported_naming_seq_len(hf_target, data_file, tmp_path, caplog,
                                                                monkeypatch):
    """Rows are cut at --seq-len as speculators cuts them, but never silently: a warning names the flag, how many
    records it cuts, the longest (its line and length) and the length that fits them all; none when all fit."""
    from parse_jax.train.eagle3_data import prepare
    from parse_jax.utils.progress import logger

    monkeypatch.setattr(logger, "propagate", True)  # the CLI's configure() turns it off: caplog listens at the root
    records = read_records(data_file, True)[:6]
    with caplog.at_level("WARNING", logger="parse_jax"):
        prepare(hf_target, data_file, Eagle3Spec(samples=6, seq_len=200, draft_vocab_size=0), tmp_path / "a",
                False, False)
    assert not [r for r in caplog.records if "--seq-len" in r.getMessage()]
    rows, _ = prepare(hf_target, data_file, Eagle3Spec(samples=6, seq_len=200, draft_vocab_size=0), tmp_path / "b",
                      False, False)
    lengths = rows[:, -1].tolist()  # at 200 nothing is cut: the rows are the records' whole lengths
    short = sorted(lengths)[2]  # cuts the three or more records longer than this
    cut = sum(n > short for n in lengths)
    caplog.clear()
    with caplog.at_level("WARNING", logger="parse_jax"):
        prepare(hf_target, data_file, Eagle3Spec(samples=6, seq_len=short, draft_vocab_size=0), tmp_path / "c",
                False, False)
    (msg,) = [r.getMessage() for r in caplog.records if "--seq-len" in r.getMessage()]
    longest = records[int(np.argmax(lengths))]["where"]
    assert f"--seq-len {short} cuts {cut} of 6 records" in msg and longest in msg
    assert f"has {max(lengths)} tokens" in msg and f"--seq-len {max(lengths)} fits them all" in msg
    caplog.clear()  # regenerated responses are written up to the row's end: only prompts that leave no room count
    with caplog.at_level("WARNING", logger="parse_jax"):
        prepare(hf_target, data_file, Eagle3Spec(samples=6, seq_len=48, draft_vocab_size=0), tmp_path / "d",
                True, False)
    assert not [r for r in caplog.records if "--seq-len" in r.getMessage()]
    # a row of one token has nothing to predict (the prompt cut to nothing): refused, not trained to a loss of 0
    with pytest.raises(InputError, match="--seq-len 1: no row keeps a response token after its prompt"):
        prepare(hf_target, data_file, Eagle3Spec(samples=6, seq_len=1, draft_vocab_size=0), tmp_path / "e",
                False, False)


def test_training_lowers_the_loss_resumes_and_the_head_loads(hf_target, data_file, tmp_path):
    class Crash(Exception):
        pass

    def crash(step):
        if step == 14:
            raise Crash

    with pytest.raises(Crash):
        train_eagle3_data(hf_target, data_file, tmp_path / "run", SPEC, regenerate=True,
                          run=PhaseOptions(progress=False, on_step=crash))
    assert latest_step(tmp_path / "run" / "head_run") == 10
    seen = []
    head = train_eagle3_data(hf_target, data_file, tmp_path / "run", SPEC, regenerate=True,
                             run=PhaseOptions(progress=False, on_step=seen.append))
    assert seen[0] == 11 and seen[-1] == 30  # resumed after the last checkpoint
    run = json.loads((tmp_path / "run" / "head_run" / "run.json").read_text())
    assert run["phase"] == "eagle3"
    assert head.config.draft_vocab == 60 and head.config.taps == (0, 1, 2)
    d2t, t2d = np.load(tmp_path / "run" / "d2t.npy"), np.load(tmp_path / "run" / "t2d.npy")
    ids = d2t + np.arange(60)
    assert t2d.sum() == 60 and t2d[ids].all() and np.array_equal(ids, np.asarray(head.params["d2t"]))
    # the loss on a fixed batch: the trained head against its random init
    from parse_jax.speculation.eagle3 import init_head
    from parse_jax.train.eagle3_data import _frozen_parts, make_data_loss, prepare

    rows, _ = prepare(hf_target, data_file, SPEC, tmp_path / "run", True, False)  # the cached rows
    batch = {"tokens": rows[:24, :-2], "prompt_len": rows[:24, -2], "length": rows[:24, -1]}
    loss = make_data_loss(hf_target, head.config, SPEC, _frozen_parts(hf_target, ids.astype(np.int32)))
    layer = {k: v for k, v in head.params.items() if k not in ("lm_head", "d2t")}
    (before, m0), (after, m1) = (loss(p, batch) for p in (init_head(head.config, SPEC.seed), layer))
    # a random target's distributions are nearly flat (their entropy bounds the loss from below): the loss falls
    # towards it, and the head's top-1 agreement with the target rises far above chance
    assert float(after) < 0.9 * float(before), (before, after)
    assert float(m1["acc0"]) > float(m0["acc0"]) + 0.3, (m0, m1)
    # it loads in both layouts, the same head
    for folder in ("eagle3", "speculators"):
        loaded = pj.load_eagle3(tmp_path / "run" / folder, hf_target)
        assert loaded.config.draft_vocab == 60 and loaded.config.taps == (0, 1, 2)
        prompts = [r["prompt"] for r in read_records(data_file, True)[1:8:2]]  # their greedy answers trained on
        res = eagle3_generate(hf_target, loaded, prompts, gamma=3, max_new_tokens=12)
        assert res.tokens == generate(hf_target, prompts, max_new_tokens=12).tokens
        assert res.stats["accepted_tokens"] > 0
    # --fresh with the full vocabulary: the earlier head's vocabulary maps go with it (they would describe another
    # head than the new eagle3/)
    import dataclasses

    full = dataclasses.replace(SPEC, draft_vocab_size=0, steps=2)
    head = train_eagle3_data(hf_target, data_file, tmp_path / "run", full, regenerate=True,
                             run=PhaseOptions(progress=False, mode="fresh"))
    assert head.config.draft_vocab is None
    assert not (tmp_path / "run" / "d2t.npy").exists() and not (tmp_path / "run" / "t2d.npy").exists()


@pytest.mark.subprocess
def test_the_cli_trains_a_head_and_generate_runs_it(tiny_hf, data_file, tmp_path):
    """`train-eagle3 --model HF --data FILE --regenerate --draft-vocab-size N`, then `generate --eagle3 DIR` with
    the speculators-format head it wrote: the target's own text."""
    import subprocess
    import sys

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "parse_jax.cli", *args], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return r

    model = str(tiny_hf("qwen3", seed=4))
    out = tmp_path / "run"
    r = cli("train-eagle3", "--model", model, "--data", str(data_file), "--out", str(out), "--regenerate",
            "--draft-vocab-size", "50", "--steps", "3", "--batch-size", "4", "--samples", "8", "--seq-len", "24",
            "--unroll", "2", "--no-progress")
    assert "speculators" in r.stdout
    cfg = json.loads((out / "speculators" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 50 and cfg["speculators_config"]["verifier"]["name_or_path"] == model
    prompt = "the answer is"
    want = cli("generate", "--model", model, "--max-new-tokens", "10", prompt).stdout
    got = cli("generate", "--model", model, "--eagle3", str(out / "speculators"), "--mode", "eagle3",
              "--max-new-tokens", "10", prompt).stdout
    assert got == want


def test_resume_without_a_checkpoint_is_refused_before_the_data_is_prepared(hf_target, data_file, tmp_path):
    """`--resume` on a folder with no checkpoint is refused before the records are encoded (or, with --regenerate,
    before the target writes every response): nothing is written."""
    from parse_jax.errors import CheckpointError

    out = tmp_path / "new"
    with pytest.raises(CheckpointError, match=r"^nothing to resume in .*new: no checkpoint in"):
        train_eagle3_data(hf_target, data_file, out, Eagle3Spec(steps=2, batch_size=2, samples=4, seq_len=24),
                          regenerate=True, run=PhaseOptions(mode="resume", progress=False))
    assert not out.exists()
