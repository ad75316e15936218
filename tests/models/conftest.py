"""Shared fixtures for model tests: tiny HF folders, built once per session and treated as read-only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.models.hf_tiny import make_tiny_hf


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_hf(family, seed=0, dtype="float32", sharded=False) -> Path`, cached per argument set.

    Tests must not modify the folder; copy it (`shutil.copytree`) before corrupting anything."""
    cache: dict[tuple, Path] = {}

    def get(family: str, seed: int = 0, dtype: str = "float32", sharded: bool = False) -> Path:
        key = (family, seed, dtype, sharded)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-s{seed}-{dtype}{'-sharded' if sharded else ''}")
            cache[key] = make_tiny_hf(family, folder, seed=seed, dtype=dtype, sharded=sharded)
        return cache[key]

    return get
