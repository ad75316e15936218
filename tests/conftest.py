"""Session-wide test settings.

The CLI keeps a persistent compile cache in the user's cache folder by default. Tests never touch it: the
environment turns the cache off for every in-process `main()` call and every CLI subprocess a test starts; the tests
of the cache itself (`tests/test_compile_cache.py`) point it at a temporary folder of their own."""

import os

import pytest

os.environ["PARSE_JAX_COMPILE_CACHE"] = "0"


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory):
    """A pair folder (target/ + draft/) of random models on the task tokenizer (read only)."""
    from parse_jax import save_model
    from tests.test_engine import DRAFT, TARGET

    d = tmp_path_factory.mktemp("pair")
    save_model(TARGET, d / "target")
    save_model(DRAFT, d / "draft")
    return d
