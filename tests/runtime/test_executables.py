"""The executable cache: a program set up once is loaded by a later process without tracing, lowering or compiling,
gives what jit gives, and is keyed by everything that makes it (its closures, its arguments, the package source);
what cannot be keyed runs as jit runs it; a broken file is compiled again, never run."""

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.runtime import executables
from parse_jax.runtime.executables import Undescribable, describe
from parse_jax.runtime.programs import _PROGRAMS, register_program, setup_split
from parse_jax.utils import progress
from tests.modes.test_parse_multi_eagle3 import DRAFT, HEAD, PROMPTS, SETTINGS, TARGET

ROOT = Path(__file__).resolve().parents[2]


def scaled(scale: float, *, offset: int = 0):
    """A program like a mode's factory makes: a closure over its settings."""

    def run(x, w):
        return jnp.tanh(x @ w) * scale + offset

    return register_program(jax.jit(run))


class Opaque:
    pass


def _traces() -> list:
    seen = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, d, **_: seen.append(event) if event.endswith("jaxpr_trace_duration") else None)
    return seen


def _exe_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.exe"))


def test_a_program_stored_once_is_loaded_untraced_and_gives_what_jit_gives(tmp_path):
    x, w = jnp.arange(12.0).reshape(3, 4), jnp.ones((4, 2)) / 7
    want = jax.jit(lambda x, w: jnp.tanh(x @ w) * 1.5 + 2)(x, w)
    traces = _traces()
    with executables.using(tmp_path):
        before = executables.stats()
        np.testing.assert_array_equal(scaled(1.5, offset=2)(x, w), want)
        assert executables.stats()["stores"] - before["stores"] == 1 and len(_exe_files(tmp_path)) == 1
        n_traces, loaded = len(traces), setup_split().loaded
        again = scaled(1.5, offset=2)  # a new process's program: same function, same closure
        np.testing.assert_array_equal(again(x, w), want)
        assert executables.stats()["loads"] - before["loads"] == 1 and len(traces) == n_traces  # loaded, untraced
        assert setup_split().loaded > loaded and again._cache_size() == 1  # its load is setup, counted
        np.testing.assert_array_equal(again(x * 0, w), jnp.full((3, 2), 2.0))  # same signature: in memory
        assert executables.stats()["loads"] - before["loads"] == 1


def test_what_makes_the_program_makes_the_key(tmp_path):
    x, w = jnp.ones((3, 4)), jnp.ones((4, 2))
    with executables.using(tmp_path):
        scaled(1.5)(x, w)
        scaled(2.5)(x, w)  # another value in the closure
        scaled(1.5, offset=1)(x, w)
        scaled(1.5)(jnp.ones((5, 4)), w)  # another shape
        scaled(1.5)(x.astype(jnp.bfloat16), w)  # another dtype
        assert len(_exe_files(tmp_path)) == 5
        np.testing.assert_allclose(scaled(2.5)(x, w), np.tanh(4.0) * 2.5, rtol=1e-6)


def test_donation_is_part_of_the_key_and_a_loaded_program_honours_it(tmp_path):
    def run(x):
        return x * 2

    with executables.using(tmp_path):
        register_program(jax.jit(run))(jnp.ones(4))
        register_program(jax.jit(run, donate_argnums=(0,)))(jnp.ones(4))
        assert len(_exe_files(tmp_path)) == 2  # the same function jitted two ways
        x = jnp.ones(4)
        loaded = register_program(jax.jit(run, donate_argnums=(0,)))
        np.testing.assert_array_equal(loaded(x), [2.0] * 4)
        assert loaded._cache_size() == 1 and x.is_deleted()


def test_the_key_reads_the_kernels_source_and_a_new_generation_prunes_only_old_ones(tmp_path, monkeypatch):
    whole = executables.source_digest()
    executables.source_digest.cache_clear()
    monkeypatch.setattr(executables, "_PACKAGES", ("parse_jax",))
    assert executables.source_digest() != whole  # pallas_kernels is read too
    executables.source_digest.cache_clear()
    old, other, recent = tmp_path / "0123456789abcdef", tmp_path / "not-a-generation", tmp_path / "fedcba9876543210"
    for folder in (old, other, recent):
        folder.mkdir()
    for folder in (old, other):
        os.utime(folder, (0, 0))
    executables._prune(tmp_path, keep="aaaaaaaaaaaaaaaa")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fedcba9876543210", "not-a-generation"]


def test_a_folder_that_cannot_be_written_leaves_the_cache_off(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    progress.configure(0)  # warnings on stderr, as the CLI shows them
    with executables.using(tmp_path / "file" / "exe"):
        assert executables.folder() is None and "executable cache off" in capsys.readouterr().err
        np.testing.assert_allclose(scaled(0.25)(jnp.ones((3, 4)), jnp.ones((4, 2))), np.tanh(4.0) * 0.25, rtol=1e-6)


def test_the_description_tells_apart_what_traces_differently():
    def make(k):
        return lambda x: x * k

    assert describe(make(2)) == describe(make(2)) != describe(make(3))
    assert describe(lambda x: x + 1) != describe(lambda x: x - 1)  # same name, other code
    assert describe(functools.partial(make, 2)) != describe(functools.partial(make, 3))
    assert describe(np.arange(3)) != describe(np.arange(3) + 1)
    assert describe(jnp.argmax) != describe(jnp.argmin)  # a library function by name
    assert describe(scaled(1.0)) == describe(scaled(1.0))  # a program another one calls: by its function
    with pytest.raises(Undescribable, match="Opaque"):
        describe(make(Opaque()))


def test_a_program_over_something_it_cannot_describe_runs_as_jit_and_stores_nothing(tmp_path):
    thing = Opaque()

    def run(x):
        return x + (thing is not None)

    program = register_program(jax.jit(run))
    with executables.using(tmp_path):
        np.testing.assert_array_equal(program(jnp.zeros(2)), [1.0, 1.0])
    assert _exe_files(tmp_path) == [] and program.description() is None


def test_a_broken_file_is_compiled_again_never_run(tmp_path, capsys):
    x, w = jnp.ones((3, 4)), jnp.ones((4, 2))
    progress.configure(0)
    with executables.using(tmp_path):
        scaled(0.5)(x, w)
        (path,) = _exe_files(tmp_path)
        path.write_bytes(path.read_bytes()[:100])  # truncated
        np.testing.assert_allclose(scaled(0.5)(x, w), np.tanh(4.0) * 0.5, rtol=1e-6)
        assert "ignored" in capsys.readouterr().err and len(path.read_bytes()) > 100  # stored again whole
    with executables.using(None):
        assert executables.folder() is None


def test_a_served_run_from_the_cache_writes_what_it_writes_without_it(tmp_path):
    """The widest closures: multi-round parse+eagle3 (draft, verification rounds, head, slots; `parse-jax bench`'s
    test in tests/utils/test_compile_cache.py runs a CLI bench through the cache)."""
    for mode, rounds in (("parse+eagle3", "multi"),):
        eng = ParseEngine(TARGET, DRAFT, ParseConfig(**{**SETTINGS, "rounds": rounds}, threshold=0.5), eagle3=HEAD)
        want = eng.generate(PROMPTS, mode=mode, max_new_tokens=12, max_batch=2, eos_ids=[]).tokens
        with executables.using(tmp_path):
            stored = eng.generate(PROMPTS, mode=mode, max_new_tokens=12, max_batch=2, eos_ids=[]).tokens
            for p in _PROGRAMS:  # what a new process holds in memory: nothing
                p._ready.clear()
            before = executables.stats()
            loaded = eng.generate(PROMPTS, mode=mode, max_new_tokens=12, max_batch=2, eos_ids=[]).tokens
            after = executables.stats()
        assert stored == want and loaded == want, mode
        assert after["loads"] - before["loads"] >= 2 and after["compiles"] == before["compiles"], mode


CHILD = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from parse_jax.utils import compile_cache
    from parse_jax.runtime import executables
    from parse_jax.runtime.programs import register_program
    compile_cache.enable(sys.argv[1])
    executables.use(sys.argv[2] if sys.argv[2] != "off" else None)

    def run(x, w):
        for _ in range(4):
            x = jnp.tanh(x @ w).T.reshape(x.shape) + jnp.cumsum(x, 0)
        return x

    x, w = jnp.ones((64, 64)), jnp.ones((64, 64)) * 0.01
    if sys.argv[3] == "jit-first":  # jax's cache loads it into jax's memory first, as plain jit
        jax.jit(run)(x, w).block_until_ready()
    print(float(register_program(jax.jit(run))(x, w).sum()), executables.stats()["loads"])
""")


@pytest.mark.subprocess
def test_a_program_in_jaxs_compile_cache_is_stored_compiled_not_reloaded(tmp_path):
    """XLA:CPU serializes an executable it loaded (here: from jax's compile cache, then held in jax's memory) without
    its fused functions, and that one then fails to run: the cache stores only what it compiled itself."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def child(exe: str, first: str = "") -> list[str]:
        out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "jax"), exe, first], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    value, _ = child("off")  # fills jax's compile cache
    assert child(str(tmp_path / "exe"), "jit-first") == [value, "0"]  # in jax's cache and memory: compiled again
    assert child(str(tmp_path / "exe")) == [value, "1"]  # loaded, and it runs
