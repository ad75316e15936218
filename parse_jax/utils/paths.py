"""Where the shipped configs are: `configs/` at the top of a source checkout (and of an editable install), installed
as `parse_jax/configs/` by a wheel (pyproject.toml maps one onto the other)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def config_dir() -> Path:
    """The folder of pair recipes, mesh presets and PARSE configs (`parse/NAME.yaml`)."""
    installed = PACKAGE_DIR / "configs"
    return installed if installed.is_dir() else PACKAGE_DIR.parent / "configs"
