"""The README's Python examples run as written, on the embedded pair: every ```python block of README.md is executed
in a fresh namespace, in a temporary working folder (its relative output paths land there). The one path a reader
replaces with their own model ("path/to/Qwen3-0.6B") is replaced by the embedded pair's target folder."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
MODEL_PLACEHOLDER = "path/to/Qwen3-0.6B"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_has_python_examples():
    blocks = python_blocks(README.read_text())
    assert blocks and any("pj.ParseEngine" in b for b in blocks)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    from parse_jax.checkpoints.pair import PAIR_DIR

    code = python_blocks(README.read_text())[index]
    code = code.replace(MODEL_PLACEHOLDER, str(PAIR_DIR / "target"))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    if "pj.evaluate" in code:
        assert namespace["res"].n == 8
