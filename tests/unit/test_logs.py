"""UNIDIST_LOG_LEVEL's handler (unidist/managers/logs.py): attached only when the variable set the level and the
script configured no logging, once, quiet once the script configures logging, removed at shutdown; the Manager's
lines then reach stderr with the rank (a real launch: tests/multiproc/test_logging.py)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from unidist.config import Config
from unidist.managers import logs

ENV = Config.from_env({"UNIDIST_LOG_LEVEL": "INFO"})


@pytest.fixture
def bare() -> Iterator[logging.Logger]:
    """The "unidist" logger at INFO, it and the root logger without handlers: pytest puts its own on the root
    logger when a test's call begins, so each test clears them with :func:`_bare` first."""
    logger = logging.getLogger(logs.LOGGER)
    saved = logger.handlers[:], logger.level
    logger.handlers = []
    logger.setLevel(logging.INFO)  # (setLevel: it also clears the loggers' cached answers to isEnabledFor)
    yield logger
    logger.handlers = saved[0]
    logger.setLevel(saved[1])


def _bare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_attached_once_with_the_rank_and_removed(bare: logging.Logger, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _bare(monkeypatch)
    handler = logs.attach(ENV, 1, 4)
    assert handler is not None and bare.handlers == [handler]
    assert logs.attach(ENV, 1, 4) is None and bare.handlers == [handler]  # once
    bare.info("hello %d", 7)
    logging.getLogger("unidist.compat.deepspeed").warning("from below")  # the package's other loggers propagate
    assert capsys.readouterr().err == "[unidist rank 1/4] INFO hello 7\n[unidist rank 1/4] WARNING from below\n"
    logs.detach(handler)
    assert bare.handlers == []
    logs.detach(None)


def test_not_attached_without_the_variable_or_over_the_scripts_logging(bare: logging.Logger,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _bare(monkeypatch)
    assert logs.attach(Config(log_level="INFO"), 0, 2) is None  # set in code, not by the variable
    assert logs.attach(Config.from_env({}), 0, 2) is None
    for logger in (logging.getLogger(), bare):
        mine = logging.StreamHandler()
        logger.addHandler(mine)
        assert logs.attach(ENV, 0, 2) is None, logger
        logger.removeHandler(mine)


def test_quiet_once_the_script_configures_logging(bare: logging.Logger, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _bare(monkeypatch)
    handler = logs.attach(ENV, 0, 2)
    assert handler is not None
    theirs = logging.StreamHandler(sys.stdout)
    logging.getLogger().addHandler(theirs)
    try:
        bare.info("once")
    finally:
        logging.getLogger().removeHandler(theirs)
        logs.detach(handler)
    out = capsys.readouterr()
    assert out.err == "" and out.out == "once\n"


@pytest.mark.parametrize(("env", "said"), [({"UNIDIST_LOG_LEVEL": "INFO"}, True), ({}, False)])
def test_a_manager_of_one_process(env: dict[str, str], said: bool) -> None:
    """No launcher: ``[unidist rank 0/1]``, and the handler gone after the ``with`` block."""
    code = ("import logging, unidist\nwith unidist.init() as mgr:\n    pass\n"
            "print(len(logging.getLogger('unidist').handlers))")
    proc = subprocess.run([sys.executable, "-c", code], env={**_clean(), **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "0\n", proc.stderr
    assert ("[unidist rank 0/1] INFO LocalManager started: rank 0 of 1 on " in proc.stderr) is said, proc.stderr
    assert said or proc.stderr == "", proc.stderr


def _clean() -> dict[str, str]:
    from helpers import clean_env

    return clean_env()
