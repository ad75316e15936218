"""The installed parse-jax version: one source of truth, pyproject.toml through the package metadata."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    try:
        return importlib.metadata.version("parse-jax")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
