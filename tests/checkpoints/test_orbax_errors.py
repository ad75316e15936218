"""Saving and restoring fail with one clear line naming the path or tensor, and never leave junk: a save under a
file or into an unwritable place, the overwrite hint for API and CLI, stale temporaries of killed saves cleaned,
a damaged Orbax data file named by its param."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orbax.checkpoint as ocp
import pytest

from parse_jax.checkpoints.load import convert_hf, load_model
from parse_jax.checkpoints.orbax import PARAMS_DIR, save_model
from parse_jax.errors import CheckpointError
from parse_jax.models.model import Model, init_params
from tests.random_models import tiny_config


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = tiny_config("qwen3")
    return Model(cfg, init_params(cfg))


def test_save_under_a_file_names_the_file(model, tmp_path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=rf"cannot write {tmp_path}/afile/sub/ckpt: {tmp_path}/afile is a file"):
        save_model(model, tmp_path / "afile" / "sub" / "ckpt")
    assert (tmp_path / "afile").read_text() == "x"


def test_save_to_an_unwritable_place_names_the_path(model, tiny_hf) -> None:
    with pytest.raises(CheckpointError, match="cannot write /proc/parse-jax-test/ckpt: cannot create") as info:
        save_model(model, "/proc/parse-jax-test/ckpt")
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="cannot write /proc/parse-jax-test/conv"):
        convert_hf(tiny_hf("qwen3"), "/proc/parse-jax-test/conv")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_save_into_a_read_only_folder(model, tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match=f"no write permission in {locked}"):
            save_model(model, locked / "ckpt")
    finally:
        locked.chmod(0o755)


def test_overwrite_hint_names_api_and_cli(model, tmp_path) -> None:
    path = save_model(model, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"already exists; pass overwrite=True \(CLI: --overwrite\)"):
        save_model(model, path)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.subprocess
def test_stale_temporaries_of_killed_saves_are_cleaned(model, tmp_path) -> None:
    dead = tmp_path / f".ckpt.tmp-{_dead_pid()}-0123abcd"
    old_style = tmp_path / ".ckpt.tmp-89abcdef"  # written before names carried a pid: cleaned when older than us
    live = tmp_path / f".ckpt.tmp-{os.getpid()}-feedbeef"  # a save in progress (this process): kept
    other = tmp_path / f".other.tmp-{_dead_pid()}-0123abcd"  # another checkpoint's: not ours to touch
    for folder in (dead, old_style, live, other):
        (folder / PARAMS_DIR).mkdir(parents=True)
        (folder / PARAMS_DIR / "blob").write_bytes(b"x" * 1000)
    past = time.time() - 60
    os.utime(old_style, (past, past))
    save_model(model, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", live.name, other.name])


def _damaged_checkpoint(model: Model, tmp_path: Path) -> Path:
    path = save_model(model, tmp_path / "ckpt")
    data = [p for p in (path / PARAMS_DIR).rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(data, key=lambda p: p.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    for i in range(64, len(raw), 5):
        raw[i] ^= 0xFF
    biggest.write_bytes(bytes(raw))
    return path


@pytest.mark.subprocess
def test_damaged_orbax_data_names_the_tensor(model, tmp_path) -> None:
    path = _damaged_checkpoint(model, tmp_path)
    with pytest.raises(CheckpointError, match=r"the data of param [\w/]+/(kernel|embedding|scale) is damaged") as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message and "TensorStore({" not in message and len(message) < 800
    assert str(path / PARAMS_DIR) in message
    # and nothing else on stderr: Orbax's other failed reads are not left to print their dumps at exit
    root = Path(__file__).resolve().parents[2]
    code = ("import sys\nfrom parse_jax import load_model\ntry:\n    load_model(sys.argv[1])\n"
            "except Exception as e:\n    print(type(e).__name__, e, file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("CheckpointError cannot restore"), proc.stderr[-3000:]
    # uncaught, the error itself is still printed (only the failed reads' leftovers are dropped)
    uncaught = "import sys\nfrom parse_jax import load_model\nload_model(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", uncaught, str(path)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    last = proc.stderr.splitlines()[-1] if proc.stderr else ""
    assert proc.returncode == 1 and "CheckpointError: cannot restore" in last, proc.stderr[-3000:]



def test_a_read_failing_while_the_restore_unwinds_prints_nothing(model, tmp_path, monkeypatch, capsys) -> None:
    """TensorStore's callback threads print a closed event loop's error through sys.excepthook (PyErr_Print) at
    any moment, also before the failed restore's error reaches parse-jax (seen under load): the hooks that drop it
    are in place before the reads start. In a process with no restore in flight and none failed, nothing is
    dropped."""
    from parse_jax.checkpoints import orbax as orbax_module

    path = save_model(model, tmp_path / "ckpt")
    # an earlier test's failed reads (this process ran them) collected now, under the hooks installed then: what
    # this test captures is its own restores' only
    gc.collect()
    capsys.readouterr()
    for hook in ("excepthook", "unraisablehook"):  # as in a fresh process: no hooks installed, no restore failed
        monkeypatch.setattr(sys, hook, getattr(sys, f"__{hook}__"))
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setattr(orbax_module, "_FAILED_FOLDERS", set())
    load_model(path)  # a good restore: the hooks are installed, and drop nothing afterwards
    sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
    assert "Event loop is closed" in capsys.readouterr().err
    try:  # nor asyncio's record of an unretrieved error raised in Orbax (an async save's, say)
        exec(compile("raise ValueError('an async save')", "/site-packages/orbax/checkpoint/save.py", "exec"))
    except ValueError as e:
        in_orbax = e
    assert _unretrieved_records([in_orbax]) == [in_orbax]
    restore = ocp.Checkpointer.restore

    def failing(self, *args, **kwargs):
        sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)  # a reader thread, mid-unwind
        restore(self, tmp_path / "missing", *args[1:], **kwargs)

    monkeypatch.setattr(ocp.Checkpointer, "restore", failing)
    with pytest.raises(CheckpointError, match="cannot restore"):
        load_model(path)
    assert capsys.readouterr().err == ""


def test_unretrieved_read_errors_of_a_failed_restore_are_not_logged(model, tmp_path) -> None:
    """Under load, asyncio logs the failed reads' futures that nobody awaited ("Future exception was never
    retrieved", 60 lines each): those naming the failed folder (as TensorStore writes it) or raised in Orbax, and
    the closed event loop's, are dropped; a sibling folder's and any other are still logged."""
    path = _damaged_checkpoint(model, tmp_path)
    (tmp_path / "sub").mkdir()
    with pytest.raises(CheckpointError, match="is damaged"):  # TensorStore names it without the `..`
        load_model(tmp_path / "sub" / ".." / path.name)
    try:  # an error raised in Orbax's own modules (a gather of its reads), as its traceback shows it
        exec(compile("raise ValueError('a gather of reads')", "/site-packages/orbax/checkpoint/read.py", "exec"))
    except ValueError as e:
        in_orbax = e
    errors = [ValueError(f'Error reading "x.kernel/0.0" at local file "{path / PARAMS_DIR}/"'), in_orbax,
              RuntimeError("Event loop is closed"),
              ValueError(f'Error reading "x" at local file "{path / PARAMS_DIR}_old/"'), ValueError("someone else's")]
    assert _unretrieved_records(errors) == errors[3:]


def _unretrieved_records(errors: list[BaseException]) -> list[BaseException]:
    """The errors asyncio logs of futures holding `errors` that nobody retrieved (collected one by one)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(handler)
    loop = asyncio.new_event_loop()
    try:
        for error in errors:
            future = loop.create_future()
            future.set_exception(error)
            del future
            gc.collect()
    finally:
        loop.close()
        asyncio_logger.removeHandler(handler)
    return [r.exc_info[1] for r in records]


KILLED_SAVE = """
import os, signal, sys
import orbax.checkpoint as ocp
from parse_jax.checkpoints.orbax import save_model
from parse_jax.models.model import Model, init_params
from tests.random_models import tiny_config

def killed(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # mid-write: config and tokenizer written, params not

ocp.Checkpointer.save = killed
cfg = tiny_config("qwen3")
save_model(Model(cfg, init_params(cfg)), sys.argv[1])
"""


@pytest.mark.subprocess
def test_a_save_killed_mid_write_is_cleaned_by_the_next(model, tmp_path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path / "ckpt")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    (left,) = tmp_path.iterdir()  # the killed run's temporary, never a half folder under the final name
    assert left.name.startswith(".ckpt.tmp-") and not (tmp_path / "ckpt").exists()
    save_model(model, tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
