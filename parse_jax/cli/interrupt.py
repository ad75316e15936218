"""Ctrl-C ends a command with exit status 130 every time, even when the KeyboardInterrupt is swallowed.

Python raises KeyboardInterrupt in whatever Python code the main thread runs next. When that is a callback that
jax (or a finalizer) calls from C++, the exception is "ignored" there and the command would go on and exit 0. So a
watcher thread sees the signal itself (through `signal.set_wakeup_fd`, written by the C-level handler the moment
the signal arrives, even while the main thread is blocked in XLA): if the main thread has not ended the command
within `GRACE_S` seconds, the watcher does (`parse-jax CMD: interrupted`, exit 130). Exiting that way is no worse
than a kill: result files are written whole or not at all and eval's appended records stay valid
(docs/bad_input.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

GRACE_S = 2.0  # how long the main thread has to end the command itself after Ctrl-C


class InterruptWatch:
    """Installed around one command by `main` (only in the main thread, and only while SIGINT raises
    KeyboardInterrupt: a process that ignores SIGINT keeps ignoring it)."""

    def __init__(self) -> None:
        self.command = "parse-jax"
        self.seen = threading.Event()        # a SIGINT arrived
        self._reported = threading.Lock()    # the "interrupted" line is printed once
        self._started = threading.Lock()     # the grace timer starts once
        self._active = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> InterruptWatch:
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        self._active = True
        threading.Thread(target=self._watch, name="parse-jax-interrupt", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        if self._timer is not None:
            self._timer.cancel()
        signal.set_wakeup_fd(self._old_fd)
        sys.unraisablehook = self._old_hook
        os.close(self._write)  # ends the watcher's read

    def report(self) -> None:
        """Print the one `interrupted` line (once, whoever gets here first)."""
        if self._reported.acquire(blocking=False):
            try:
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            print(f"{self.command}: interrupted", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:  # the write end closed: the command is over
                os.close(self._read)
                return
            if signal.SIGINT in data:
                self._interrupted()

    def _interrupted(self) -> None:
        self.seen.set()
        if self._started.acquire(blocking=False):
            self._timer = threading.Timer(GRACE_S, self._exit)
            self._timer.daemon = True
            self._timer.start()

    def _exit(self) -> None:
        if self._active:  # the main thread did not end the command (its KeyboardInterrupt was swallowed)
            self.report()
            os._exit(130)

    def _unraisable(self, info) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt) and self._active:
            self._interrupted()  # a swallowed Ctrl-C: no "Exception ignored ..." traceback; the timer ends the command
            return
        self._old_hook(info)
