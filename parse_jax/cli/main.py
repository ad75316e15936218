"""`parse-jax` command line: generate, bench, sweep, calibrate, eval, convert, train, train-eagle3, profile, lower.

`main` runs one command and turns every parse-jax error into one line on stderr (exit 2), Ctrl-C into exit 130.
"""

from __future__ import annotations

import os
import sys

from parse_jax.cli.interrupt import InterruptWatch
from parse_jax.cli.parser import build_parser, check_args
from parse_jax.errors import ParseJaxError


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status: 0 done, 2 bad input (one line on stderr naming it), 130
    interrupted (Ctrl-C: one line, no traceback; what was finished is on disk, results written whole or not at
    all, eval's appended records intact so a rerun resumes; also when a callback swallowed the KeyboardInterrupt,
    see cli/interrupt.py)."""
    from parse_jax.utils import progress

    try:
        with InterruptWatch() as watch:
            return _run(argv, watch)
    finally:
        progress.restore_bars()  # --no-progress is this command's: a caller's later library calls draw bars again


def _run(argv: list[str] | None, watch: InterruptWatch) -> int:
    command = "parse-jax"
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, or a usage error (already printed as one line)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        args.argv = argv
        command = watch.command = f"parse-jax {args.command}"
        from parse_jax.utils import compile_cache, progress

        if args.quiet and hasattr(args, "no_progress"):
            args.no_progress = True
        # phases and diagnostics on stderr, results on stdout; --no-progress hides every bar, the loaders' too
        progress.configure(args.verbose - args.quiet, bars=not getattr(args, "no_progress", False))
        check_args(args, parser)
        folder = compile_cache.cache_dir(disabled=args.no_compile_cache)
        if folder is not None:  # before the first compilation: JAX decides once per process
            folder = compile_cache.enable(folder)
        if hasattr(args, "mesh"):  # multi-host start-up and the device mesh, before anything touches a device
            from parse_jax.distributed.multihost import initialize_from_args

            args.mesh_obj = initialize_from_args(args)
        from parse_jax.runtime import executables

        exe = folder / executables.SUBFOLDER if folder is not None and compile_cache.executables_on() else None
        with executables.using(exe):
            rc = args.func(args)
        if watch.seen.is_set():  # Ctrl-C came, and something swallowed its KeyboardInterrupt
            raise KeyboardInterrupt
        return rc
    except ParseJaxError as e:
        print(f"{command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        watch.report()
        if argv is None:  # the process's own command line (console script, python -m): exit now. Finished work is
            os._exit(130)  # on disk already; interpreter teardown while XLA threads still compile can crash
        return 130
