"""What a person sees while a long command runs: phase messages and diagnostics through the `parse_jax` logger,
progress bars through tqdm, both on stderr (results go to stdout).

Library code logs phases at INFO and counts with `bar(...)`. Nothing shows until someone configures the logger
(the CLI does, with `configure`: INFO by default, `-q` warnings only, `-v` debug), so `import parse_jax` in a user's
program stays quiet. Importing this module does not import jax (the CLI builds its parser without it).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("parse_jax")


class _StderrHandler(logging.Handler):
    """Writes to whatever `sys.stderr` is at the time of the message (pytest and callers may swap it). A warning this
    handler said already is not said again: it lives for one command (`configure` makes a new one), and a command
    that builds several engines over one model (sweep: one per value) warns about the model once."""

    def __init__(self) -> None:
        super().__init__()
        self._warned: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            text = record.getMessage()
            if text in self._warned:
                return
            self._warned.add(text)
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # a closed stream must not end the run
            self.handleError(record)


_BARS = {"on": True}  # --no-progress: no bar, the loaders' included, while phase messages still show


def configure(verbosity: int = 0, bars: bool = True) -> None:
    """Show `parse_jax` messages on stderr: verbosity <= -1 warnings only, 0 phases (INFO), >= 1 debug; `bars`
    False: progress bars that follow the logger stay hidden (a command's --no-progress)."""
    _BARS["on"] = bars
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    if verbosity < -1:
        level = logging.ERROR
    for h in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(h)  # main() may run many times in one process (tests)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("parse-jax: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def restore_bars() -> None:
    """Bars follow the logger again (what `configure(bars=False)` turned off for one command)."""
    _BARS["on"] = True


def phase(message: str) -> None:
    """A one-line note that a long step without a count starts (loading, restoring, compiling)."""
    logger.info(message)


def shown() -> bool:
    """Whether phase messages (and the progress bars that follow the logger) are shown."""
    return logger.isEnabledFor(logging.INFO)


def bar(total: int | None = None, desc: str = "", enabled: bool | None = None, iterable: Iterable | None = None,
        **kw: Any):
    """A tqdm progress bar on stderr (over `iterable` if given); `enabled=None` follows the logger (shown when
    phases are)."""
    from tqdm import tqdm

    on = (shown() and _BARS["on"]) if enabled is None else enabled
    return tqdm(iterable, total=total, desc=desc, disable=not on, file=sys.stderr, dynamic_ncols=True, **kw)
