"""Python run on N fake CPU devices in a subprocess (jax fixes its device count when it starts), from the
repository root: the meshes of the sharding tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def device_env(devices: int) -> dict[str, str]:
    """This process's environment with `devices` fake CPU devices and the repository on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_on_devices(code: str, *args: str, devices: int = 4, timeout: int = 600) -> Any:
    """`python -c code *args` on `devices` fake CPU devices; the last line it prints, read as JSON."""
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=device_env(devices),
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
