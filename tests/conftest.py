"""Session-wide test settings.

Compiled programs are shared across the whole test session, its xdist workers and every CLI subprocess a test starts:
the session keeps JAX's persistent compilation cache in a folder of its own (`PARSE_JAX_TEST_COMPILE_CACHE`, default
`~/.cache/parse-jax/tests-jax`; `0` turns it off), never the user's CLI cache. JAX keys each entry by the program,
the versions, the backend and the flags, so a test never runs a program other than the one it built; a second run
of the suite loads what the first compiled. The tests of the cache itself (`tests/utils/test_compile_cache.py`) point
it at a temporary folder of their own."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from parse_jax.utils import compile_cache

_TEST_CACHE = os.environ.get("PARSE_JAX_TEST_COMPILE_CACHE", "").strip() or str(
    Path.home() / ".cache" / "parse-jax" / "tests-jax")
if _TEST_CACHE.lower() in compile_cache.OFF_VALUES:
    os.environ[compile_cache.ENV_VAR] = "0"
else:
    os.environ[compile_cache.ENV_VAR] = _TEST_CACHE  # CLI subprocesses and in-process main() calls
    compile_cache.enable(_TEST_CACHE)  # library calls in this process
# no executable cache in the CLI commands the suite runs: they would compile apart from the programs the library tests
# compile into the cache above (its tests, tests/runtime/test_executables.py, turn it on themselves)
os.environ[compile_cache.EXECUTABLES_VAR] = "0"


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory):
    """A pair folder (target/ + draft/) of random models on the task tokenizer (read only)."""
    from parse_jax import save_model
    from tests.test_engine import DRAFT, TARGET

    d = tmp_path_factory.mktemp("pair")
    save_model(TARGET, d / "target")
    save_model(DRAFT, d / "draft")
    return d


RSS_LIMIT_BYTES = 3 * 2**30


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Every jitted program keeps its executables for the life of the process; hundreds of test modules' worth of
    them (each PARSE program holds a few verification passes) outgrow a 24 GiB CI machine. After a module, when the
    process holds more than RSS_LIMIT_BYTES, drop JAX's compilation caches (later modules compile what they need)."""
    yield
    if os.path.exists("/proc/self/statm") and _rss_bytes() > RSS_LIMIT_BYTES:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_hf(family, seed=0, dtype="float32", sharded=False) -> Path`, cached per argument set.

    Tests must not modify the folder; copy it (`shutil.copytree`) before corrupting anything."""
    from tests.models.hf_tiny import make_tiny_hf

    cache: dict[tuple, Path] = {}

    def get(family: str, seed: int = 0, dtype: str = "float32", sharded: bool = False) -> Path:
        key = (family, seed, dtype, sharded)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-s{seed}-{dtype}{'-sharded' if sharded else ''}")
            cache[key] = make_tiny_hf(family, folder, seed=seed, dtype=dtype, sharded=sharded)
        return cache[key]

    return get


@pytest.fixture
def parse_jax_warnings(monkeypatch) -> list[str]:
    """The messages the `parse_jax` logger warns with during a test, each once (whatever handlers an earlier CLI
    test configured, and without the root logger's copy)."""
    import logging

    from parse_jax.utils.progress import logger

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    monkeypatch.setattr(logger, "handlers", [Collect(logging.WARNING)])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    return messages
