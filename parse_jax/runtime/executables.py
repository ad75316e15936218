"""The executable cache: each program's compiled executable kept on disk under a key that needs no tracing, so a later
process loads it without tracing, lowering or compiling it.

jax's persistent compile cache (`utils/compile_cache`) keys an entry by the lowered program: a process traces and
lowers every program before it can look it up, and on a CPU that is most of a PARSE admission's setup (single-round
PARSE over a 256-problem eval at batch 8: traced 3.4 s, lowered 1.0 s, loaded 1.9 s). This cache keys an executable
by what the program is made from instead:
- the function and everything its closures hold: configs, sizes, the callables it calls (`describe`);
- the arguments' tree, shapes, dtypes and placements (`signature`);
- the source of this package, and the versions, device and jax settings that change a program (`environment`).
A program whose closures hold something that cannot be described this way (a mesh, an arbitrary object) is never
stored: it runs as jit runs it.

Off unless a folder is set (`use`); the CLI sets one inside its compile cache's folder. The key reads this package's
source files, not a function patched into a module at run time: a process that patches parse_jax's functions must
leave it off. A file that cannot be read or loaded is set aside with a one-line warning and the program compiled
again; deleting the folder is always safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import time
import types
from pathlib import Path

import jax
import numpy as np
from jax._src.array import ArrayImpl  # the type of a concrete jax array
from jax._src.config import trace_context as _trace_context  # what jit keys its programs on, beyond the arguments

from parse_jax.errors import InputError
from parse_jax.utils import atomic, compile_cache
from parse_jax.utils.progress import logger

FORMAT = 2  # 2: each file keeps the seconds its executable took to set up here
LOAD_EVENT = "/parse_jax/executables/load_duration"  # seconds to load one executable (runtime.programs counts it)
# what loading an executable saves, against what it costs (`runtime.programs.SetupSplit` reads them): once a load
# has succeeded, just before its LOAD_EVENT, the seconds its executable took to trace, lower and compile where it was
# stored; around a compile here, a start mark (0 s) and, at its end, its seconds (0 where it was not stored)
LOAD_SAVED_EVENT = "/parse_jax/executables/load_saved"
COMPILE_START_EVENT = "/parse_jax/executables/compile_start"
COMPILE_EVENT = "/parse_jax/executables/compile_duration"
_MAX_DEPTH = 24
_MAX_ARRAY = 1 << 20  # bytes of an array a closure may hold and still be described (hashed)
_LIBRARIES = ("jax", "jaxlib", "flax", "numpy", "optax", "builtins", "math", "operator", "functools")
_PACKAGES = ("parse_jax", "pallas_kernels")  # the source a traced program reads (the key's digest)
_JIT_OPTIONS_SKIPPED = ("fun_sourceinfo", "fun_signature")  # of jit's options: what the description has already
FRESH = {"xla_embed_ir_in_executable": False}  # the default: a compile that no in-memory cache of jax holds
SUBFOLDER = "executables"  # the CLI's, inside its compile cache's folder
KEEP_DAYS = 7  # a generation (package source and versions) not used for this long is removed at the next store
_GENERATION = re.compile(r"^[0-9a-f]{16}$")
_state: dict = {"dir": None, "loads": 0, "stores": 0, "compiles": 0, "store_failed": False}


def use(folder: str | Path | None) -> Path | None:
    """Keep executables in `folder`; None turns the cache off. A folder that cannot be written is a warning and
    leaves the cache off (every program would otherwise compile without jax's cache, to be stored nowhere). Returns
    the folder, or None."""
    _state["dir"], _state["store_failed"] = None, False
    if folder is not None:
        try:
            _state["dir"] = atomic.check_writable(Path(folder).expanduser().absolute())
        except InputError as e:
            logger.warning(f"executable cache off: {e}")
    return _state["dir"]


@contextlib.contextmanager
def using(folder: str | Path | None):
    """The cache in `folder` for what runs inside, then as it was (a CLI command called in a process that goes on)."""
    was = _state["dir"]
    use(folder)
    try:
        yield
    finally:
        _state["dir"] = was


def folder() -> Path | None:
    """Where executables are kept now (None: off)."""
    return _state["dir"]


def stats() -> dict:
    """{"dir", "loads": executables loaded from disk, "stores": written, "compiles": programs set up here} so far."""
    return {k: (str(v) if k == "dir" and v is not None else v) for k, v in _state.items()}


class Undescribable(Exception):
    """Something a program is made from that no key can stand for: the program is not stored."""


def describe(obj, depth: int = 0):
    """A JSON-able description of `obj` that is equal across processes exactly when `obj` makes the same program:
    values by value, dataclasses (flax modules too) by type and fields, functions by name, code and closure, library
    callables by name (their versions are in the key). Raises `Undescribable` for anything else."""
    if depth > _MAX_DEPTH:
        raise Undescribable("nested too deep")
    d = depth + 1
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return ["float", repr(obj)]
    if isinstance(obj, bytes):
        return ["bytes", hashlib.sha256(obj).hexdigest()]
    if isinstance(obj, enum.Enum):
        return ["enum", _name(type(obj)), obj.name]
    if isinstance(obj, type):
        return ["type", _name(obj)]
    if isinstance(obj, (tuple, list)):
        return [type(obj).__name__, [describe(x, d) for x in obj]]
    if isinstance(obj, (set, frozenset)):
        return ["set", sorted((describe(x, d) for x in obj), key=json.dumps)]
    if isinstance(obj, dict):
        return ["dict", sorted(([describe(k, d), describe(v, d)] for k, v in obj.items()), key=json.dumps)]
    if isinstance(obj, (np.dtype, np.generic)):
        return ["np", type(obj).__name__, repr(obj)]
    if isinstance(obj, jax.core.Tracer):
        raise Undescribable("a traced value")
    if isinstance(obj, (np.ndarray, jax.Array)):
        return _describe_array(obj)
    if isinstance(obj, Program) or (type(obj).__module__.startswith("jaxlib") and
                                    isinstance(getattr(obj, "__wrapped__", None), types.FunctionType)):
        return ["jit", describe(obj.__wrapped__, d)]  # a program another one calls: traced into it
    if isinstance(obj, functools.partial):
        return ["partial", describe(obj.func, d), describe(obj.args, d), describe(obj.keywords, d)]
    if isinstance(obj, types.MethodType):
        return ["method", describe(obj.__self__, d), obj.__func__.__name__]
    if isinstance(obj, types.FunctionType) and not str(obj.__module__).startswith(_LIBRARIES):
        cells = {n: c.cell_contents if _filled(c) else "<empty>"
                 for n, c in zip(obj.__code__.co_freevars, obj.__closure__ or ())}
        try:
            return ["function", _name(obj), _code_digest(obj.__code__), describe(cells, d),
                    describe(obj.__defaults__, d), describe(obj.__kwdefaults__, d)]
        except Undescribable as e:  # say where: "admit > verify > judge: SomeType"
            raise Undescribable(f"{obj.__qualname__} > {e}") from None
    if callable(obj) and str(getattr(obj, "__module__", None)).split(".")[0] in _LIBRARIES and \
            hasattr(obj, "__qualname__"):
        return ["library", _name(obj)]
    if dataclasses.is_dataclass(obj):
        from flax import linen as nn

        skip = ("parent",) if isinstance(obj, nn.Module) else ()
        return ["dataclass", _name(type(obj)),
                [[f.name, describe(getattr(obj, f.name), d)] for f in dataclasses.fields(obj) if f.name not in skip]]
    raise Undescribable(f"{type(obj).__module__}.{type(obj).__qualname__}")


def _name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _code_digest(code: types.CodeType) -> str:
    """The bytecode, names and constants of `code` (nested functions' too): two functions of one name differ here."""
    h = hashlib.sha256(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_firstlineno)).encode())
    for c in code.co_consts:  # a frozenset's repr follows the hash seed: sorted
        text = sorted(map(repr, c)) if isinstance(c, frozenset) else c
        h.update(_code_digest(c).encode() if isinstance(c, types.CodeType) else repr(text).encode())
    return h.hexdigest()


def _describe_array(x) -> list:
    if x.nbytes > _MAX_ARRAY or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        raise Undescribable(f"an array of {x.nbytes} bytes")  # checked before any copy to the host
    x = np.asarray(x)
    return ["array", str(x.dtype), list(x.shape), hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()]


def _leaf(x) -> tuple:
    """What a program's setup depends on in one argument: its shape, dtype, weak type and placement."""
    if type(x) is ArrayImpl:  # nearly every leaf: checked first, by exact type (this runs on every call)
        return ("array", x.shape, x.dtype, x.weak_type, x.sharding)
    if isinstance(x, jax.core.Tracer):  # called inside another program: part of that one
        raise Undescribable("a traced argument")
    if isinstance(x, jax.Array):
        return ("array", x.shape, x.dtype, x.weak_type, x.sharding)
    if isinstance(x, np.ndarray):
        return ("numpy", x.shape, x.dtype)
    if isinstance(x, np.generic):
        return ("numpy", (), x.dtype)
    if isinstance(x, (bool, int, float, complex)):
        return ("python", type(x).__name__)
    raise Undescribable(type(x).__name__)


def signature(args: tuple) -> tuple:
    """The arguments' tree and each leaf's `_leaf`: hashable, the key of one executable within a process."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple(_leaf(x) for x in leaves)


def _signature_text(sig: tuple) -> list:
    tree, leaves = sig
    return [str(tree), [[str(p) if not isinstance(p, jax.sharding.Sharding) else _sharding_text(p) for p in leaf]
                        for leaf in leaves]]


def _sharding_text(s: jax.sharding.Sharding) -> str:
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        (device,) = s.device_set
        return f"single:{device.platform}:{device.id}:{s.memory_kind}"
    return repr(s)


@functools.cache
def source_digest() -> str:
    """A digest of every Python file of the packages traced programs read (this one and its kernels): any change to
    their code makes every key new."""
    import importlib.util

    h = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(importlib.util.find_spec(package).origin).parent
        for path in sorted(root.rglob("*.py")):
            h.update(f"{package}/{path.relative_to(root)}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _versions() -> dict:
    """The format, versions and source an executable was built from (a process's: computed once)."""
    import flax
    import jaxlib

    return {"format": FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "source": source_digest()}


def generation() -> str:
    """The subfolder of this package's source and versions: what an upgrade or an edit leaves behind as a whole."""
    return hashlib.sha256(json.dumps(_versions(), sort_keys=True).encode()).hexdigest()[:16]


def _prune(root: Path, keep: str) -> None:
    """Remove the generations other than `keep` not used for `KEEP_DAYS` (their programs can never load again)."""
    cutoff = time.time() - KEEP_DAYS * 86400
    for old in root.iterdir() if root.is_dir() else ():
        with contextlib.suppress(OSError):
            if _GENERATION.match(old.name) and old.is_dir() and old.name != keep and old.stat().st_mtime < cutoff:
                shutil.rmtree(old)


def environment() -> dict:
    """The versions, devices and settings an executable was built for."""
    backend = jax.extend.backend.get_backend()
    return {**_versions(), "platform": backend.platform, "platform_version": backend.platform_version,
            "devices": sorted({d.device_kind for d in jax.devices()}), "device_count": jax.device_count(),
            "process": [jax.process_index(), jax.process_count()],
            "trace_context": _trace_context_text(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _trace_context_text() -> list[str]:
    """`_trace_context` (jax's settings that jit keys its programs on: x64, precision, default device, the abstract
    mesh...) as text that is equal across processes."""
    return [re.sub(r" at 0x[0-9a-f]+", "", repr(v)) for v in _trace_context()]


def _jit_options(jitted) -> dict:
    """The options a program was jitted with (donation, static arguments, shardings, compiler options)."""
    info = getattr(jitted, "_jit_info", None)
    if info is None:
        raise Undescribable("a program without jit's options")
    return {k: repr(getattr(info, k)) for k in info._fields if k not in _JIT_OPTIONS_SKIPPED}


class Program:
    """A jitted program that, with the cache on, runs each argument signature as an executable loaded from the cache
    (or compiled here, then stored); with it off, exactly the jitted function. Everything else (`lower`, `trace`,
    `_cache_size`...) is the jitted function's; `_cache_size` counts the executables this object holds too."""

    def __init__(self, jitted):
        self.jitted = jitted
        self.__name__ = getattr(jitted, "__name__", "program")
        self.__wrapped__ = getattr(jitted, "__wrapped__", jitted)
        self._ready: dict[tuple, object] = {}
        self._description: list | None = None
        self._describable = True

    def __getattr__(self, name):
        try:
            jitted = self.__dict__["jitted"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(jitted, name)

    def _cache_size(self) -> int:
        return self.jitted._cache_size() + len(self._ready)

    def __call__(self, *args, **kwargs):
        """The executable of these arguments' signature; jit itself where the cache is off, the program cannot be
        described, it is called with keywords or inside another program."""
        if _state["dir"] is None or not self._describable or kwargs:
            return self.jitted(*args, **kwargs)
        try:
            sig = (signature(args), _trace_context())
            run = self._ready.get(sig)  # hashes the signature (TypeError: an unhashable leaf)
        except (Undescribable, TypeError):
            return self.jitted(*args)
        if run is not None:
            return run(*args)
        run, path = self._set_up(args, sig)
        if run is None:
            return self.jitted(*args)
        try:
            out = run(*args)
        except Exception:
            if path is not None:  # loaded: a file that loads but cannot run is removed, never run again
                with contextlib.suppress(OSError):
                    path.unlink()
                logger.warning(f"executable cache: {path} failed to run; removed (the next run compiles it)")
            raise
        self._ready[sig] = run
        return out

    def description(self) -> list | None:
        """`describe` of the function this program jits, None where it cannot be described (computed once)."""
        if self._describable and self._description is None:
            try:
                self._description = [describe(self.__wrapped__), _jit_options(self.jitted)]
            except Undescribable as e:
                logger.debug(f"executable cache: {self.__name__} not stored ({e})")
                self._describable = False
        return self._description

    def _set_up(self, args: tuple, sig: tuple):
        """(executable, its file where it was loaded from one, else None); (None, None) where the program cannot be
        described or an earlier store failed (it runs as jit runs it from then on)."""
        description = self.description()
        if description is None or _state["store_failed"]:
            return None, None
        key = hashlib.sha256(json.dumps([description, _signature_text(sig[0]), environment()], sort_keys=True,
                                        default=str).encode()).hexdigest()
        path = _state["dir"] / generation() / f"{re.sub(r'[^A-Za-z0-9_]', '_', self.__name__)}-{key[:40]}.exe"
        loaded = _load(path, key)
        if loaded is not None:
            return loaded, path
        jax.monitoring.record_event_duration_secs(COMPILE_START_EVENT, 0.0)
        start = time.perf_counter()
        with compile_cache.paused():  # XLA:CPU serializes an executable it loaded without its fused functions (that
            # copy then fails to run), so store only one compiled here: not from jax's persistent cache, nor from its
            # in-memory one (a compile option set to its default makes the compile new)
            compiled = self.jitted.lower(*args).compile(compiler_options=FRESH)
        seconds = time.perf_counter() - start
        _state["compiles"] += 1
        stored = _store(path, key, compiled, seconds)
        # ends the compile's mark; 0 s: not stored (the next process compiles it again: no load saves it)
        jax.monitoring.record_event_duration_secs(COMPILE_EVENT, seconds if stored else 0.0)
        return compiled, None


def _load(path: Path, key: str):
    """The executable stored at `path` under `key`, loaded onto this process's devices; None where there is none
    (or it cannot be used: set aside with a warning)."""
    from jax.experimental import serialize_executable

    start = time.perf_counter()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning(f"executable cache: {path} not read ({e.strerror or e}); compiling")
        return None
    try:
        stored_format, stored_key, payload, in_tree, out_tree, set_up = pickle.loads(data)
        if stored_format != FORMAT or stored_key != key:
            raise ValueError("its key does not match its name")
        set_up = float(set_up)
        if not 0.0 <= set_up < float("inf"):
            raise ValueError(f"its setup seconds are {set_up}")
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # a truncated, foreign or stale file: compile instead, never run it
        logger.warning(f"executable cache: {path} ignored ({type(e).__name__}: {e}); compiling")
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None
    seconds = time.perf_counter() - start  # reading the file included
    jax.monitoring.record_event_duration_secs(LOAD_SAVED_EVENT, set_up)
    jax.monitoring.record_event_duration_secs(LOAD_EVENT, seconds)
    _state["loads"] += 1
    with contextlib.suppress(OSError):
        os.utime(path.parent)  # this generation is in use
    return compiled


def _store(path: Path, key: str, compiled, seconds: float) -> bool:
    """Write `compiled` under `key`, with the `seconds` it took to set up here; whether it was written. A failure is
    a warning, and this process stores nothing more (nor compiles for the cache: its programs run as jit runs
    them)."""
    from jax.experimental import serialize_executable

    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        atomic.write_bytes(path, pickle.dumps((FORMAT, key, payload, in_tree, out_tree, float(seconds))))
        _state["stores"] += 1
        os.utime(path.parent)  # this generation is in use
        _prune(path.parent.parent, keep=path.parent.name)
    except Exception as e:  # a full disk, a backend that cannot serialize: the run goes on uncached
        _state["store_failed"] = True
        logger.warning(f"executable cache: {path.name} not stored ({type(e).__name__}: {e}); storing no more")
        return False
    return True
