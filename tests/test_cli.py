"""`parse-jax generate` and `parse-jax convert` as a user runs them: the console script, in a subprocess."""

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


def test_cli_errors_are_one_line_messages(tmp_path, hf_dir):
    r = _cli("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert r.returncode == 2 and "nowhere" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--model", str(hf_dir), "")
    assert r.returncode == 2 and "empty" in r.stderr and "Traceback" not in r.stderr
