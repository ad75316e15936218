"""The CLI's persistent JAX compilation cache: compiled programs are kept on disk, so a second run of a command
loads them instead of compiling again (compilation is most of a short bench on a CPU).

On by default for `parse-jax`, in `$XDG_CACHE_HOME/parse-jax/jax` (`~/.cache/parse-jax/jax`);
`PARSE_JAX_COMPILE_CACHE=DIR` moves it, `PARSE_JAX_COMPILE_CACHE=0` or `--no-compile-cache` turns it off.
JAX keys every entry by the program, jax/jaxlib versions, backend and flags, so a stale entry is never used;
deleting the folder is always safe. The library itself (`import parse_jax`) leaves JAX's settings alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from parse_jax.utils.progress import logger

ENV_VAR = "PARSE_JAX_COMPILE_CACHE"
EXECUTABLES_VAR = "PARSE_JAX_EXECUTABLES"
OFF_VALUES = ("0", "off", "false", "no", "none")
_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_state: dict = {"dir": None, "hits": 0, "misses": 0, "listening": False}


def default_dir(env: Mapping[str, str] | None = None) -> Path:
    """$XDG_CACHE_HOME/parse-jax/jax, else ~/.cache/parse-jax/jax."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "parse-jax" / "jax"


def executables_on(env: Mapping[str, str] | None = None) -> bool:
    """Whether the CLI keeps executables beside the compile cache (`runtime.executables`): yes unless
    `PARSE_JAX_EXECUTABLES` is one of `OFF_VALUES` (the test suite's processes, which patch functions)."""
    env = os.environ if env is None else env
    return env.get(EXECUTABLES_VAR, "").strip().lower() not in OFF_VALUES


def cache_dir(disabled: bool = False, env: Mapping[str, str] | None = None) -> Path | None:
    """The folder the CLI caches compiled programs in, or None when turned off (flag or environment)."""
    env = os.environ if env is None else env
    value = env.get(ENV_VAR, "").strip()
    if disabled or value.lower() in OFF_VALUES:
        return None
    return Path(value).expanduser() if value else default_dir(env)


def _count(event: str, **_kw) -> None:
    key = _EVENTS.get(event)
    if key is not None:
        _state[key] += 1


def enable(folder: str | Path) -> Path | None:
    """Point JAX's persistent cache at `folder` and cache every program (small ones too: on a CPU most of ours
    compile in well under JAX's default 1 s threshold). Call before the first compilation: JAX decides once per
    process whether it uses the cache. Returns the folder, or None (with a warning) when it cannot be created."""
    import jax

    folder = Path(folder).expanduser().absolute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning(f"compile cache off: cannot create {folder}: {e.strerror or e}")
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if not _state["listening"]:
        jax.monitoring.register_event_listener(_count)
        _state["listening"] = True
    _state["dir"] = str(folder)
    logger.debug(f"compile cache: {folder}")
    return folder


def active() -> bool:
    """Whether this process's compiled programs go to (and come from) a persistent compile cache: the CLI's
    (`enable`) or one a library user set in jax's config. As configured: jax decides at its first compile whether
    it uses the cache (a folder set later is not used), and by default stores only programs that took a second or
    more to compile (`enable` stores every one)."""
    import jax

    return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


def stats() -> dict:
    """{"dir": folder or None, "hits": programs loaded from the cache, "misses": programs compiled} so far."""
    return {"dir": _state["dir"], "hits": _state["hits"], "misses": _state["misses"]}


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """jax's persistent compile cache off for what runs inside, then as it was (jax decides once per process whether
    it uses the cache: reset around). Programs compiled inside are neither read from nor written to it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()
