"""The CLI's persistent compile cache: where it lives, how it is turned off, and that a second run in a fresh process
loads every program instead of compiling it (counted, not timed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parse_jax.utils import compile_cache


def test_cache_folder_follows_the_environment(tmp_path):
    home = str(Path.home())
    assert compile_cache.cache_dir(env={}) == Path(home) / ".cache" / "parse-jax" / "jax"
    assert compile_cache.cache_dir(env={"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "parse-jax" / "jax"
    assert compile_cache.cache_dir(env={compile_cache.ENV_VAR: str(tmp_path / "c")}) == tmp_path / "c"
    for off in ("0", "off", "OFF", "false", "none"):
        assert compile_cache.cache_dir(env={compile_cache.ENV_VAR: off}) is None
    assert compile_cache.cache_dir(disabled=True, env={compile_cache.ENV_VAR: str(tmp_path)}) is None


def test_an_unusable_cache_folder_is_a_warning_not_an_error(tmp_path, capsys):
    from parse_jax.utils import progress

    blocker = tmp_path / "file"
    blocker.write_text("")
    progress.configure(0)
    assert compile_cache.enable(blocker / "cache") is None
    assert "compile cache off" in capsys.readouterr().err


def _bench(pair_dir: Path, out: Path, cache: Path, **env_vars) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, compile_cache.ENV_VAR: str(cache), **env_vars}
    cmd = [sys.executable, "-m", "parse_jax.cli", "bench", "--pair", str(pair_dir), "--n", "2", "--modes",
           "target,parse", "--max-new-tokens", "6", "--batch-size", "2", "--repeats", "1", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    return r, json.loads(out.read_text())


@pytest.mark.subprocess
def test_a_second_bench_in_a_fresh_process_compiles_nothing(pair_dir, tmp_path):
    cache = tmp_path / "cache"
    r1, first = _bench(pair_dir, tmp_path / "a.json", cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert first["compile_cache"]["dir"] == str(cache.absolute())
    assert first["compile_cache"]["misses"] > 0 and len(entries) >= first["compile_cache"]["misses"] > 0
    assert "compiling (warm-up runs)" in r1.stderr  # the warm-up says what it is doing

    r2, second = _bench(pair_dir, tmp_path / "b.json", cache)
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing new was written
    assert second["compile_cache"]["misses"] == 0 and second["compile_cache"]["hits"] > 0
    assert "loaded from the compile cache, 0 compiled" in r2.stderr
    assert second["modes"]["parse"]["new_tokens"] == first["modes"]["parse"]["new_tokens"]


@pytest.mark.subprocess
def test_a_second_bench_loads_its_programs_from_the_executable_cache(pair_dir, tmp_path):
    """As a user runs it (the suite turns the executable cache off elsewhere): the first process compiles and stores
    its programs, the second loads them without compiling and writes the same tokens."""
    cache = tmp_path / "cache"
    on = {compile_cache.EXECUTABLES_VAR: "1"}
    _, first = _bench(pair_dir, tmp_path / "a.json", cache, **on)
    stored = sorted(p.name for p in (cache / "executables").rglob("*.exe"))
    assert first["executables"]["compiles"] == len(stored) > 0 and first["executables"]["loads"] == 0
    r2, second = _bench(pair_dir, tmp_path / "b.json", cache, **on)
    assert second["executables"]["compiles"] == 0 and second["executables"]["loads"] == len(stored)
    assert sorted(p.name for p in (cache / "executables").rglob("*.exe")) == stored
    assert f"{len(stored)} loaded from the executable cache, 0 compiled for it" in r2.stderr
    assert second["modes"]["parse"]["new_tokens"] == first["modes"]["parse"]["new_tokens"]


@pytest.mark.subprocess
def test_no_compile_cache_flag_and_env_leave_jax_alone(pair_dir, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, compile_cache.ENV_VAR: str(cache)}
    cmd = [sys.executable, "-m", "parse_jax.cli", "generate", "--pair", str(pair_dir), "--mode", "target",
           "--max-new-tokens", "3", "--no-compile-cache", "1 :"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert not cache.exists()


_SPLIT = """
import sys, jax, jax.numpy as jnp
from parse_jax.utils import compile_cache
from parse_jax.runtime.programs import setup_split
compile_cache.enable(sys.argv[1])
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0).cumsum())
f(jnp.ones((64, 32))).block_until_ready()
s = setup_split()
print(compile_cache.active(), s.compiled, s.loaded, s.seconds)
"""


@pytest.mark.subprocess
def test_setup_is_split_into_compiled_and_loaded_programs(tmp_path):
    """jax's durations, attributed as `SetupSplit` reads them: a fresh cache compiles (nothing loaded), and the same
    programs in the next process are loaded (what is left of their backend's durations, the cache key's hashing,
    is a fraction of compiling them)."""
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _SPLIT, str(tmp_path / "cache")], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        active, *figures = r.stdout.split()
        runs.append((active, *map(float, figures)))
    (active1, compiled1, loaded1, seconds1), (active2, compiled2, loaded2, seconds2) = runs
    assert active1 == active2 == "True"
    assert compiled1 > 0 and loaded1 == 0 and compiled1 <= seconds1
    assert loaded2 > 0 and compiled2 < 0.5 * compiled1 and loaded2 <= seconds2
