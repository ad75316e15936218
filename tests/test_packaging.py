"""The wheel is a complete install: built from the repo (no network), installed into a fresh venv, it trains the
embedded pair from its packaged recipe (`parse_jax/configs/pair_default.yaml`) from another folder, and its metadata
declares what the code needs (python >= 3.11, jax floors, ml_dtypes, the cuda12 / tpu extras)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # its module fixture runs the checks in a subprocess

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the repo's sources (the checkout itself gets no build/ or egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("parse_jax", "pallas_kernels", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", ".",
          "-w", str(tmp / "dist")], cwd=src)
    (built,) = (tmp / "dist").glob("parse_jax-*.whl")
    return built


def test_wheel_ships_configs_and_declares_its_needs(wheel) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for config in ("pair_default.yaml", "mesh_data2_model4.yaml", "mesh_model_all.yaml", "parse/qwen3_chat.yaml",
                   "models/qwen3-8b.json"):
        assert f"parse_jax/configs/{config}" in names  # the repository's top-level configs/, inside the package
    assert "parse_jax/assets/tokenizer/tokenizer.json" in names
    assert "Requires-Python: >=3.11" in meta
    requires = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert any(r.startswith("ml_dtypes>=") for r in requires)
    jax_floor = next(r for r in requires if r.startswith("jax>="))
    assert tuple(int(x) for x in jax_floor[5:].split(".")[:2]) >= (0, 7)  # jax.shard_map(axis_names=...)
    assert any("jax[cuda12]" in r and 'extra == "cuda12"' in r for r in requires)
    assert any("jax[tpu]" in r and 'extra == "tpu"' in r for r in requires)


@pytest.mark.slow
def test_installed_wheel_trains_from_another_folder(wheel, tmp_path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    python, cli = venv / "bin" / "python", venv / "bin" / "parse-jax"
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(PARSE_JAX_COMPILE_CACHE="0", JAX_PLATFORMS="cpu")
    where = _run([str(python), "-c", "import parse_jax; print(parse_jax.__file__)"], cwd=elsewhere, env=env)
    assert where.stdout.strip().startswith(str(venv)), where.stdout  # the wheel, not the checkout
    run = tmp_path / "run"
    _run([str(cli), "train", "--recipe", "pair_default", "--steps", "2", "--out", str(run), "--no-progress"],
         cwd=elsewhere, env=env, timeout=1500)
    assert (run / "target" / "parse_jax_config.json").is_file() and (run / "draft" / "parse_jax_config.json").is_file()
    assert not any(elsewhere.iterdir())  # nothing written relative to the working folder
    named = ("from parse_jax.cli import build_parser\nfrom parse_jax.cli.setup import parse_config_fields\n"
             "args = build_parser().parse_args(['generate', '--parse-config', 'qwen3_chat', 'x'])\n"
             "print(parse_config_fields(args)['suffix_format'])")
    assert _run([str(python), "-c", named], cwd=elsewhere, env=env).stdout.strip() == "chat"


def test_the_package_list_names_every_package_on_disk() -> None:
    """pyproject.toml lists the packages explicitly (configs/ is mapped into parse_jax/configs/): a new folder of
    modules must be listed there too, or the wheel would ship without it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for root in ("parse_jax", "pallas_kernels")
               for p in (ROOT / root).rglob("__init__.py")}
    assert listed == on_disk | {"parse_jax.configs"}
