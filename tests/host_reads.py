"""Record every read of a device array's values on the host, with where it came from.

On a GPU or TPU `jax.transfer_guard_device_to_host("disallow")` catches such reads, but on CPU a jax.Array is host
memory: numpy reads it through the buffer protocol and the guard never fires. So the tests watch the entry points a
read goes through (numpy's array constructors, and `ArrayImpl._value`, which int(), bool(), .tolist(), str() and
jax.device_get use) and keep the Python stack of each read."""

import contextlib
import sys
from collections.abc import Iterator

import jax
import numpy as np
from jax._src import array as jax_array

NUMPY_READS = ("asarray", "array", "asanyarray", "ascontiguousarray")


def _holds_device_array(x) -> bool:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return True
    return isinstance(x, (list, tuple)) and any(_holds_device_array(v) for v in x[:64])


def _inside(function: str, file_suffix: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(file_suffix):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def host_reads(allowed_in: tuple[str, str] = ("fetch", "parse_jax/runtime/programs.py")) -> Iterator[list[str]]:
    """Yield a list that fills with one entry (the reading function's name and line) per host read of a device array
    made outside `allowed_in` (function name, file suffix): by default outside `programs.fetch`, the one transfer
    a generation is allowed."""
    outside: list[str] = []

    def note() -> None:
        if not _inside(*allowed_in):
            caller = sys._getframe(2)
            outside.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {caller.f_code.co_name}")

    value = jax_array.ArrayImpl.__dict__["_value"]
    originals = {name: getattr(np, name) for name in NUMPY_READS}

    def counted_value(self):
        note()
        return value.fget(self)

    def wrap(name):
        original = originals[name]

        def read(x, *args, **kwargs):
            if _holds_device_array(x):
                note()
            return original(x, *args, **kwargs)

        return read

    jax_array.ArrayImpl._value = property(counted_value)
    for name in NUMPY_READS:
        setattr(np, name, wrap(name))
    try:
        yield outside
    finally:
        jax_array.ArrayImpl._value = value
        for name, original in originals.items():
            setattr(np, name, original)
