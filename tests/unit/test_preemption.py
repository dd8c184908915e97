"""mgr.preemption() on one process (the local backend): the handler's flag, every=, refused arguments, close(),
requeue outside and inside a (stand-in) Slurm job, and the grace: real signals throughout, raised to this
process, or to a child process where the signal's default would end it (SIGTERM)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import clean_env

import unidist
from unidist.errors import InvalidArgumentError


@pytest.fixture
def mgr() -> Iterator[Any]:
    with unidist.init(environ={}) as m:
        yield m


def test_a_signal_sets_the_flag_and_requested_reports_it(mgr: Any) -> None:
    stop = mgr.preemption(signals=("SIGUSR1", "SIGUSR2"))
    try:
        assert stop.signal is None and stop.received_at is None and not stop.requested()
        before = time.time()
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGUSR1)  # a later, different one: the first is kept
        signal.raise_signal(signal.SIGUSR2)  # a repeat while pending: noted once, nothing else
        assert stop.signal == "SIGUSR2" and before <= stop.received_at <= time.time()
        assert stop.requested() and stop.requested()  # stays True
        assert stop.signal == "SIGUSR2"
    finally:
        stop.close()


def test_every_agrees_on_every_kth_call_only(mgr: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    exchanged: list[int] = []
    real = mgr.allreduce_

    def counted(x: Any, op: Any = "sum") -> Any:
        exchanged.append(int(x[0]))
        return real(x, op)

    monkeypatch.setattr(mgr, "allreduce_", counted)
    stop = mgr.preemption(signals=("USR1",), every=3)
    try:
        assert [stop.requested() for _ in range(3)] == [False, False, False]
        assert exchanged == [0]
        signal.raise_signal(signal.SIGUSR1)
        assert [stop.requested() for _ in range(3)] == [False, False, True]  # seen at the 6th call, not the 4th
        assert exchanged == [0, signal.SIGUSR1]
        assert stop.requested() and len(exchanged) == 2  # once True, no more exchanges
    finally:
        stop.close()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"signals": ("SIGNOPE",)}, "'SIGNOPE' is not a signal"),
    ({"signals": ("SIGKILL",)}, "SIGKILL cannot be caught"),
    ({"signals": (3.5,)}, "3.5 is not a signal"),
    ({"signals": ()}, "names no signal"),
    ({"every": 0}, "every=0"),
    ({"every": True}, "every=True"),
    ({"grace": 0}, "grace=0"),
])
def test_bad_arguments_are_refused_and_install_nothing(mgr: Any, kwargs: dict[str, Any], match: str) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(InvalidArgumentError, match=match):
        mgr.preemption(**kwargs)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_off_the_main_thread_is_refused(mgr: Any) -> None:
    caught: list[BaseException] = []

    def install() -> None:
        try:
            mgr.preemption()
        except BaseException as err:
            caught.append(err)

    t = threading.Thread(target=install)
    t.start()
    t.join()
    assert len(caught) == 1 and isinstance(caught[0], InvalidArgumentError), caught
    assert "main thread" in str(caught[0])


def test_close_restores_the_previous_handlers(mgr: Any) -> None:
    seen: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGUSR2, mine)
    try:
        term = signal.getsignal(signal.SIGTERM)
        stop = mgr.preemption(signals=("SIGUSR2", signal.SIGTERM))
        assert signal.getsignal(signal.SIGUSR2) != mine
        with pytest.raises(InvalidArgumentError, match="already handling"):
            mgr.preemption()
        stop.close()
        stop.close()  # twice is fine
        assert signal.getsignal(signal.SIGUSR2) == mine and signal.getsignal(signal.SIGTERM) == term
        signal.raise_signal(signal.SIGUSR2)
        assert seen == [signal.SIGUSR2]
        mgr.preemption(signals=("SIGUSR2",)).close()  # a new one once the old is closed
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_the_manager_closes_it_at_shutdown() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with unidist.init(environ={}) as m:
        stop = m.preemption()
        assert signal.getsignal(signal.SIGUSR1) != before
    assert stop.closed and signal.getsignal(signal.SIGUSR1) == before


def test_requeue_outside_slurm_is_false(mgr: Any, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    stop = mgr.preemption()
    try:
        assert stop.requeue() is False
    finally:
        stop.close()
    assert capsys.readouterr().err == ""


def _scontrol(tmp_path: Path, body: str) -> Path:
    """A stand-in ``scontrol`` first on PATH (no Slurm here): it records its arguments, then runs ``body``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "scontrol"
    exe.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "argv"}\n{body}\n')
    exe.chmod(0o755)
    return bindir


@pytest.mark.parametrize(("env", "job"), [({"SLURM_JOB_ID": "4242"}, "4242"),
                                          ({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "7",
                                            "SLURM_ARRAY_TASK_ID": "3"}, "7_3")])
def test_requeue_in_a_slurm_job_runs_scontrol(mgr: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              env: dict[str, str], job: str) -> None:
    bindir = _scontrol(tmp_path, "exit 0")
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    stop = mgr.preemption()
    try:
        assert stop.requeue() is True
    finally:
        stop.close()
    assert (tmp_path / "argv").read_text().split() == ["requeue", job]


def test_requeue_refused_by_slurm_is_false_with_its_words(mgr: Any, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bindir = _scontrol(tmp_path, 'echo "scontrol: error: Requested operation is presently disabled for job 4242" >&2'
                                 "\nexit 1")
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    stop = mgr.preemption()
    try:
        assert stop.requeue() is False
        monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
        assert stop.requeue() is False
    finally:
        stop.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("unidist: scontrol requeue 4242 failed (the job needs sbatch --requeue")
    assert err[0].endswith("Requested operation is presently disabled for job 4242")
    assert err[1] == "unidist: cannot requeue Slurm job 4242: scontrol is not on PATH"


# Children for what a SIGTERM's default would do to this process. They start together (their sleeps overlap).
CHILDREN = {
    # two SIGTERMs while one is pending: alive; requested() reports it, which cancels the grace (1 s)
    "repeat": """
        stop = mgr.preemption(grace=1.0)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        print("alive", stop.requested(), stop.signal, flush=True)
        time.sleep(1.5)
        print("still alive", flush=True)
    """,
    # the loop never asks: after the grace SIGTERM is raised again with its default, which ends the process
    "grace": """
        stop = mgr.preemption(grace=0.5)
        signal.raise_signal(signal.SIGTERM)
        for _ in range(100):
            time.sleep(0.1)
        print("never ended", flush=True)
    """,
    # ... and a main thread blocked in C (system() retries its wait on EINTR) cannot run the handler: the grace
    # thread ends the process itself, FALLBACK_SECONDS later
    "blocked": """
        unidist.train.preempt.FALLBACK_SECONDS = 0.5
        stop = mgr.preemption(grace=0.5)
        signal.raise_signal(signal.SIGTERM)
        os.system("exec sleep 5 >/dev/null 2>&1")  # the child holds none of our pipes
        print("never ended", flush=True)
    """,
}


@pytest.fixture(scope="module")
def children() -> dict[str, tuple[subprocess.CompletedProcess[str], float]]:
    head = "import os, signal, time\nimport unidist, unidist.train.preempt\nwith unidist.init(environ={}) as mgr:\n"
    started = {name: (subprocess.Popen([sys.executable, "-c", head + textwrap.indent(textwrap.dedent(body), "    ")],
                                       env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                      time.monotonic()) for name, body in CHILDREN.items()}
    done = {}
    for name, (proc, t0) in started.items():
        out, err = proc.communicate(timeout=120)
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0)
    return done


def test_a_repeated_sigterm_while_pending_does_not_kill(children: dict[str, Any]) -> None:
    proc, _ = children["repeat"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["alive True SIGTERM", "still alive"], proc.stdout


def test_sigterm_unreported_within_the_grace_ends_the_process(children: dict[str, Any]) -> None:
    proc, seconds = children["grace"]
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert "rank 0: SIGTERM arrived 0.5 s ago and stop.requested() has not reported it" in proc.stderr
    assert "never ended" not in proc.stdout and seconds < 30


def test_sigterm_with_the_main_thread_blocked_in_c_still_ends_the_process(children: dict[str, Any]) -> None:
    proc, seconds = children["blocked"]
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert "the main thread did not run the handler within 0.5 s (blocked in C)" in proc.stderr
    assert "never ended" not in proc.stdout and seconds < 30
