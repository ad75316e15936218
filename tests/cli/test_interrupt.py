"""Ctrl-C and kill -9 never destroy finished work: a bench interrupted by SIGINT exits 130 with one line
and no traceback, and a SIGKILL mid-run leaves the previous result byte-identical; the next run writes its result
and removes the killed run's temporaries. An eval interrupted either way keeps every appended record valid and the
rerun resumes without counting a record twice.

The interrupted runs are real processes (`python -m parse_jax.cli`); the reruns go through `main()` in this process.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parse_jax.cli import main


def _start(*args: str) -> subprocess.Popen:
    # compiling afresh (no persistent cache) keeps the runs long enough to be interrupted mid-way
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PARSE_JAX_COMPILE_CACHE": "0"}
    # a pytest-xdist worker ignores SIGINT and its children inherit that: give the run the default a shell gives it
    return subprocess.Popen([sys.executable, "-m", "parse_jax.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parents[2],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 120.0, poll: float = 0.1) -> None:
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "the run never got going"
        time.sleep(poll)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.subprocess
def test_bench_interrupted_or_killed_keeps_the_previous_result(pair_dir, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_bytes(b'{"previous": "result"}\n')
    stale = tmp_path / f".good.json.tmp-{_dead_pid()}-0badc0de"  # a run killed while writing, long ago
    stale.write_text('{"half')
    args = ["bench", "--pair", str(pair_dir), "--n", "2", "--modes", "target,parse", "--max-new-tokens", "8",
            "--batch-size", "1", "--repeats", "2000", "--json", str(good), "--no-progress"]
    marker = tmp_path / "started"
    for sig in (signal.SIGINT, signal.SIGKILL):
        proc = _start(*args, "--out", str(marker))  # --out folder: created only when results are written
        # started: past argument checks, loading or compiling (no "running" placeholder may appear meanwhile)
        time.sleep(0.5)
        _wait_for(lambda p=proc: p.poll() is not None or _loaded(p), proc)
        time.sleep(2.0)
        assert good.read_bytes() == b'{"previous": "result"}\n'
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert good.read_bytes() == b'{"previous": "result"}\n'  # byte-identical
        assert not marker.exists()
        if sig == signal.SIGINT:
            assert proc.returncode == 130, err
            assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
            assert err.strip().splitlines()[-1] == "parse-jax bench: interrupted", err
            assert err.count("interrupted") == 1
        else:
            assert proc.returncode == -signal.SIGKILL
    assert stale.exists()  # nothing written yet, so nothing cleaned yet
    rc = main([*args[:-5], "--repeats", "1", "--json", str(good), "--no-progress", "-q"])
    assert rc == 0, capsys.readouterr().err
    assert set(json.loads(good.read_text())["modes"]) == {"target", "parse"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.json"]  # the stale temporary is gone


_STDERR: dict[int, str] = {}


def _loaded(proc: subprocess.Popen) -> bool:
    """Whether the process has printed its "loading the pair" phase (read without blocking)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    while sel.select(timeout=0):
        line = proc.stderr.readline()
        if not line:
            break
        _STDERR[proc.pid] = _STDERR.get(proc.pid, "") + line
        if "loading the pair" in line:
            return True
    return "loading the pair" in _STDERR.get(proc.pid, "")


@pytest.mark.subprocess
def test_eval_interrupted_or_killed_resumes_without_double_counting(pair_dir, tmp_path, capsys):
    from parse_jax.tasks import load_task

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in load_task().problems(120, 9)))
    out = tmp_path / "results.jsonl"
    args = ["eval", "--pair", str(pair_dir), "--data", str(data), "--out", str(out), "--mode", "target",
            "--max-new-tokens", "8", "--batch-size", "1", "--no-progress"]

    def results() -> list[dict]:
        lines = out.read_text().splitlines() if out.exists() else []
        parsed = [json.loads(x) for x in lines]  # every line valid JSON at every moment
        return [r for r in parsed if r.get("type") == "result"]

    seen = 0
    for sig in (signal.SIGINT, signal.SIGKILL):
        proc = _start(*args)
        _wait_for(lambda n=seen: len(results()) >= n + 1, proc, timeout=180, poll=0.01)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        if sig == signal.SIGINT:
            assert proc.returncode == 130 and "Traceback" not in err, err
            assert err.strip().splitlines()[-1] == "parse-jax eval: interrupted", err
        else:
            assert proc.returncode == -signal.SIGKILL
        done = results()
        assert len(done) >= seen + 1 and len({r["key"] for r in done}) == len(done)
        seen = len(done)
    assert seen < 120, "the runs finished before they were interrupted; the test proves nothing"
    rc = main([*args[:-3], "--batch-size", "16", "--no-progress", "-q"])  # not in the header: a rerun may change it
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert f"{seen} of 120 records already done" in stdout
    done = results()
    assert len(done) == 120 and len({r["key"] for r in done}) == 120
    summary = json.loads((tmp_path / "results.summary.json").read_text())
    assert summary["n"] == 120


SWALLOWED = """
import os, signal, sys
import parse_jax.cli.parser as parser
from parse_jax.cli.main import main

class Swallow:  # what a callback called from C++ does with the KeyboardInterrupt raised in it: "Exception ignored"
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**6):
            pass

real = parser.cmd_generate

def generate_after_a_swallowed_ctrl_c(args):
    Swallow()  # dropped at once: Ctrl-C arrives while its finalizer runs, and is swallowed there
    return real(args)  # the real command goes on

parser.cmd_generate = generate_after_a_swallowed_ctrl_c
main()
"""


@pytest.mark.subprocess
def test_generate_exits_130_when_a_callback_swallows_ctrl_c(pair_dir):
    """Ctrl-C caught in a callback (jax calls some from C++: the KeyboardInterrupt is printed as "Exception ignored"
    and lost) still ends the command with one line and exit 130, not a finished run with exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", SWALLOWED, "generate", "--pair", str(pair_dir), "--mode", "parse", "--max-new-tokens",
         "8", "-q", "( 1 + 2 ) :"], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 130, proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == ["parse-jax generate: interrupted"], proc.stderr
