"""Provenance in every result: package versions, the source checkout, the machine, the time, the config and seed.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import jax

from parse_jax.utils.host import cpu_identity

PROVENANCE_PACKAGES = ("parse-jax", "jax", "jaxlib", "flax", "orbax-checkpoint")



def package_versions() -> dict[str, str | None]:
    """Installed versions (importlib.metadata) of parse-jax and the libraries its numbers depend on; None when one
    is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in PROVENANCE_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out



def source_checkout() -> Path | None:
    """The repository root when parse_jax runs from a source checkout (an editable install or PYTHONPATH), else
    None (a wheel install has no commit to record)."""
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists() and (root / "pyproject.toml").is_file():
        return root
    return None



def provenance(config: dict | None = None, seed: int | None = None) -> dict:
    """What made a result: package versions, the commit (and whether the tree had uncommitted changes) when run
    from a source checkout (null otherwise, never a guess), device, config, seed."""
    root = source_checkout()

    def git(*args: str) -> str | None:
        if root is None:
            return None
        try:
            r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    devices, cpu = jax.devices(), cpu_identity()
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status),
            "versions": package_versions(), "jax": jax.__version__, "device": str(devices[0]),
            "device_kind": devices[0].device_kind, "device_count": len(devices), "platform": platform.platform(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(), "cpu": cpu["cpu_model"],
            "cpu_flags": cpu["cpu_flags"],
            "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "config": config, "seed": seed}



def format_provenance(p: dict) -> str:
    dirty = " (uncommitted changes)" if p.get("git_dirty") else ""
    version = (p.get("versions") or {}).get("parse-jax")
    where = f"Commit {p['git_commit'][:12]}{dirty}" if p.get("git_commit") else f"parse-jax {version}"
    return (f"{where}; jax {p['jax']} on {p['device']} ({p['device_count']} device(s), "
            f"{p.get('cpu_count')} CPU cores{', ' + p['cpu'] if p.get('cpu') else ''}); {p['time_utc']}; "
            f"seed {p.get('seed')}.")
