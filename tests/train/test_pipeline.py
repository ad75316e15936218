"""`parse-jax train` end to end on a tiny recipe: draft, draft samples, target; outputs load with pj.load_model."""

import json

import pytest

from parse_jax import load_model
from parse_jax.cli import main
from parse_jax.train.pipeline import SAMPLES_FILE
from parse_jax.train.trainer import latest_step

TINY = """
seq_len: 44
draft_model: {{hidden_size: 16, num_layers: 1, num_heads: 2, num_kv_heads: 2, intermediate_size: 32}}
target_model: {{hidden_size: {h}, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 32}}
draft: {{steps: 4, batch_size: 8, warmup_steps: 1, checkpoint_every: 2}}
target: {{steps: 4, batch_size: 8, warmup_steps: 1, checkpoint_every: 2}}
judge: {{error_fraction: 0.5, real_fraction: 0.5, draft_samples: 16, sample_batch: 16}}
"""


@pytest.fixture
def recipes(tmp_path):
    a, b = tmp_path / "tiny.yaml", tmp_path / "other.yaml"
    a.write_text(TINY.format(h=16))
    b.write_text(TINY.format(h=32))
    return a, b


def test_train_cli_end_to_end_resume_and_errors(recipes, tmp_path, capsys):
    a, b = recipes
    out = tmp_path / "pair"
    assert main(["train", "--recipe", str(tmp_path / "missing.yaml")]) == 2
    assert main(["train", "--recipe", str(a), "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert main(["train", "--recipe", str(a), "--out", str(out), "--no-progress"]) == 0
    draft, target = load_model(out / "draft"), load_model(out / "target")
    assert draft.tokenizer is not None and target.config.hidden_size == 16 and draft.config.hidden_size == 16
    assert latest_step(out / "draft_run") == 4 and latest_step(out / "target_run") == 4
    samples = json.loads((out / SAMPLES_FILE).read_text())["samples"]
    assert len(samples) == 16
    # Rerunning the same command: every phase is finished, nothing is trained again, same outputs.
    capsys.readouterr()
    assert main(["train", "--recipe", str(a), "--out", str(out), "--resume", "--no-progress"]) == 0
    out_text, err_text = capsys.readouterr()
    assert "reusing 16 draft samples" in err_text  # phase messages on stderr: stdout holds the result alone
    assert out_text.splitlines() == [f"wrote {out / 'draft'} and {out / 'target'}"]
    # Another recipe on the same folder: a clear one-line error, exit 2.
    assert main(["train", "--recipe", str(b), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # phase messages, then the error: one line
    assert err[-1].startswith("parse-jax train: error: ") and "another config" in err[-1] and "hidden_size" in err[-1]
    assert all(line.startswith("[") for line in err[:-1])
    # --fresh starts over: an earlier run's finished models go with its checkpoints (a grown target of an earlier
    # run, target_narrow/, would otherwise sit beside the new pair; the old draft/ beside a new target)
    import shutil

    shutil.copytree(out / "target", out / "target_narrow")
    stale = (out / "draft" / "params").stat().st_mtime_ns
    assert main(["train", "--recipe", str(b), "--out", str(out), "--fresh", "--no-progress"]) == 0
    assert not (out / "target_narrow").exists() and (out / "draft" / "params").stat().st_mtime_ns != stale
    assert load_model(out / "target").config.hidden_size == 32
