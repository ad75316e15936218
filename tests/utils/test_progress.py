"""Phase messages and progress bars: on stderr, at the verbosity asked for, silent in a plain library call."""

import logging

from parse_jax.utils import progress


def test_levels_follow_verbosity(capsys):
    for verbosity, info, warning, debug in ((0, True, True, False), (-1, False, True, False),
                                           (1, True, True, True), (-2, False, False, False)):
        progress.configure(verbosity)
        progress.phase("a phase")
        progress.logger.warning("a warning")
        progress.logger.debug("a detail")
        out, err = capsys.readouterr()
        assert out == ""
        assert ("a phase" in err, "a warning" in err, "a detail" in err) == (info, warning, debug), verbosity
        assert progress.shown() == info


def test_bars_follow_the_logger_unless_told(capsys):
    progress.configure(0)
    with progress.bar(3, "counting") as b:
        b.update(3)
    assert "counting" in capsys.readouterr().err
    progress.configure(-1)
    with progress.bar(3, "hidden") as b:
        b.update(3)
    with progress.bar(2, "forced", enabled=True) as b:
        b.update(2)
    err = capsys.readouterr().err
    assert "hidden" not in err and "forced" in err


def test_a_library_user_sees_nothing_until_logging_is_configured(capsys):
    logger = progress.logger
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    try:
        for h in handlers:
            logger.removeHandler(h)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True  # as in a fresh process: the root logger decides (WARNING)
        progress.phase("quiet please")
        with progress.bar(2, "no bar") as b:
            b.update(2)
        assert capsys.readouterr().err == ""
    finally:
        for h in handlers:
            logger.addHandler(h)
        logger.setLevel(level)
        logger.propagate = propagate


def test_no_progress_hides_every_bar_the_loaders_too(tmp_path, capsys):
    """A command's --no-progress: no bar (a loader's "reading ..." included), the phase messages still shown."""
    from parse_jax.cli import main
    from tests.models.hf_tiny import make_tiny_hf

    folder = make_tiny_hf("qwen3", tmp_path / "hf", seed=2)
    capsys.readouterr()
    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "a")]) == 0
    assert "tensor/s" in capsys.readouterr().err  # the loader's bar, by default
    try:
        progress.configure(0, bars=False)
        with progress.bar(3, "counting") as b:
            b.update(3)
        assert "counting" not in capsys.readouterr().err
    finally:
        progress.configure(0)  # as other tests expect it
    from parse_jax.harness.eval.data import write_task_jsonl
    from parse_jax.tasks import load_task

    data = write_task_jsonl(load_task(), 1, tmp_path / "p.jsonl", seed=1)
    assert main(["eval", "--model", str(folder), "--mode", "target", "--data", str(data), "--max-new-tokens", "2",
                 "--out", str(tmp_path / "r.jsonl"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "tensor/s" not in err and "loading the target" in err
    with progress.bar(3, "after the command") as b:  # its --no-progress ended with it
        b.update(3)
    assert "after the command" in capsys.readouterr().err
