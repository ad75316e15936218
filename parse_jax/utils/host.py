"""The host processor, as profiles and run records name it. jax calls every CPU device "cpu", so without this a
pass-cost profile measured on one machine (a shared home directory, a cluster of mixed nodes) would be read on
another, and a benchmark record would not say which processor made it."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path


def cpu_identity() -> dict[str, str | int | None]:
    """This host's processor (`describe_cpu` of /proc/cpuinfo, where there is one); a fresh dict each call."""
    return dict(_cpu_identity())


@functools.cache
def _cpu_identity() -> dict[str, str | int | None]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return describe_cpu(text)


def describe_cpu(cpuinfo: str) -> dict[str, str | int | None]:
    """The processor's model name, a digest of its instruction-set flags (what XLA's CPU code generation reads:
    two machines sold under one name can differ there) and the cores this process sees."""
    model = flags = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:  # x86; ARM
            flags = " ".join(sorted(value.split()))
    return {"cpu_model": model or platform.processor() or platform.machine(),
            "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:12] if flags else None,
            "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
