"""The watchdog's liveness channel between hosts (unidist/comm/liveness.py) on loopback: what each kind of
answer, or its absence, is taken to mean, and the words the watchdog puts on it. The cluster test
(tests/cluster/test_cluster_faults.py) makes the same faults happen for real on two simulated hosts."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from unidist.comm import liveness, processes, watchdog
from unidist.comm.liveness import Answer, Beacon, Endpoint, probe

TAG = liveness.job_tag("job")


@pytest.fixture
def served() -> Iterator[Beacon]:
    """A beacon on loopback answered by a thread, as a rank's watchdog does."""
    beacon = Beacon("127.0.0.1", TAG)
    beacon.line = "1700000000.000 123:456@m hostB at call #7 waiting in allreduce(float32[4])"
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set() and not beacon.serve(0.05):
            pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield beacon
    stop.set()
    beacon.wake()
    t.join()
    beacon.close()


def _at(rank: int, port: int, host: str = "hostB") -> Endpoint:
    return Endpoint(rank, host, "elsewhere", "127.0.0.1", port)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_serving_rank_answers_with_its_heartbeat(served: Beacon) -> None:
    got = probe([_at(2, served.port)], TAG, 2.0)
    assert got == {2: Answer("alive", line=served.line)}


def test_nothing_listening_is_a_process_gone() -> None:
    got = probe([_at(3, _closed_port())], TAG, 2.0)
    assert got[3].kind == "refused" and "refused" in got[3].detail


def test_a_listener_that_never_answers_is_silent() -> None:
    """A stopped process: its kernel takes the connection, the process never accepts it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        got = probe([_at(1, s.getsockname()[1])], TAG, 0.3)
        assert got[1].kind == "silent" and 0.25 < time.monotonic() - t0 < 2


def test_no_connection_before_the_deadline_is_unreachable() -> None:
    """A SYN nobody answers (a cut link) is made on loopback by a full accept queue: Linux drops the SYN."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        filler = socket.create_connection(("127.0.0.1", port), timeout=1)  # backlog 0 holds this one
        try:
            got = probe([_at(1, port)], TAG, 0.4)
        finally:
            filler.close()
    if got[1].kind == "silent":  # a kernel that queued one more: cannot make the drop here
        pytest.skip("this kernel accepted past the backlog")
    assert got[1] == Answer("unreachable", detail="no answer in 0.4 s")
    assert liveness._failed(errno.EHOSTUNREACH).kind == liveness._failed(errno.ENETUNREACH).kind == "unreachable"


def test_another_program_on_the_port_is_not_taken_for_the_rank(served: Beacon) -> None:
    got = probe([_at(2, served.port)], liveness.job_tag("another job"), 2.0)
    assert got[2].kind == "refused" and "another program" in got[2].detail


def test_all_are_asked_at_once(served: Beacon) -> None:
    """Three silent ranks cost one deadline, not three; a rank that probes still answers its own probes."""
    listeners = []
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        listeners.append(s)
    mine = Beacon("127.0.0.1", TAG)
    mine.line = "1.000 1:1@m hostA computing"
    try:
        heard: dict[int, Answer] = {}
        asker = threading.Thread(target=lambda: heard.update(probe([_at(0, mine.port)], TAG, 2.0)))
        t0 = time.monotonic()
        asker.start()
        got = probe([_at(i, s.getsockname()[1]) for i, s in enumerate(listeners)], TAG, 0.5, serving=mine)
        asker.join()
        assert time.monotonic() - t0 < 1.5
        assert [a.kind for a in got.values()] == ["silent"] * 3
        assert heard == {0: Answer("alive", line=mine.line)}
    finally:
        mine.close()
        for s in listeners:
            s.close()


def test_serving_stops_at_once_when_woken() -> None:
    beacon = Beacon("127.0.0.1", TAG)
    woken: list[bool] = []
    t = threading.Thread(target=lambda: woken.append(beacon.serve(30)))
    t.start()
    t0 = time.monotonic()
    beacon.wake()
    t.join(5)
    beacon.close()
    assert woken == [True] and time.monotonic() - t0 < 1


def test_a_link_without_carrier_is_named() -> None:
    assert liveness.link_down("127.0.0.1", read=lambda path: "0\n") == "lo"
    assert liveness.link_down("127.0.0.1", read=lambda path: "1\n") is None
    assert liveness.link_down("192.0.2.7") is None  # no interface of this host has it


def test_the_watchdog_names_far_ranks_and_their_host(served: Beacon, tmp_path: object,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """start() exchanges endpoints; the ranks of this machine are left to the heartbeat files; the others are
    described from their answers."""
    monkeypatch.setattr(watchdog, "_HEARTBEATS", str(tmp_path))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    far = [_at(1, served.port, "h2"), _at(2, _closed_port(), "h2"), _at(3, silent.getsockname()[1], "h3")]
    t0 = time.monotonic()
    try:
        watchdog.start(60.0, 0, 5, "job", lambda code: None, address="127.0.0.1",
                       exchange=lambda mine: [tuple(mine), *[tuple(e) for e in far],
                                              (4, "h1", processes.machine(), "127.0.0.1", 1)])
        dog = watchdog._dog
        assert dog is not None and dog.far == far and watchdog.calls() == 0
        said = dog.far_peers()
    finally:
        watchdog.stop()
        silent.close()
    assert time.monotonic() - t0 < 4
    assert said == [
        "rank 1 is alive on host h2 at call #7 waiting in allreduce(float32[4])",
        "rank 2 has died (its process is gone: connection refused) on host h2",
        "rank 3 is not responding (stopped or hung: its host took the probe, its watchdog did not answer: "
        "connected, no answer in 1 s) on host h3",
    ]


def test_under_mpiexec_a_rank_asks_hydra_to_end_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    r, w = os.pipe()
    monkeypatch.setenv("PMI_FD", str(w))
    monkeypatch.setattr(processes, "ABORT_GRACE", 0.0)
    try:
        processes.launcher_abort(124)
        assert os.read(r, 100) == b"cmd=abort exitcode=124\n"
    finally:
        os.close(r)
        os.close(w)
    monkeypatch.delenv("PMI_FD")
    processes.launcher_abort(124)  # not under hydra: nothing to do


# A stand-in for torchrun's agent (a script named torchrun): it starts one worker that, as a rank of a host that
# lost its link does, calls processes.stop_agent; then either acts on SIGTERM by stopping the worker and exiting
# (its main thread in Python) or cannot (torchrun blocked in the store's recv, which restarts after a signal).
_AGENT = """
import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[2]], env={**os.environ, "TORCHELASTIC_RUN_ID": "x"})
if sys.argv[1] == "acts":
    def stop(sig, frame):
        worker.terminate()
        sys.exit(15)
    signal.signal(signal.SIGTERM, stop)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
worker.wait()
time.sleep(30)  # the worker is gone but the agent is not: only a signal ends it here
"""
_WORKER = (f"import importlib.util as u; s = u.spec_from_file_location('p', {processes.__file__!r}); "
           "m = u.module_from_spec(s); s.loader.exec_module(m); m.stop_agent(1.0)")


@pytest.mark.parametrize(("behaviour", "code"), [("acts", 15), ("stuck", -9)])
def test_a_cut_off_rank_ends_its_torchrun_agent(tmp_path: Path, behaviour: str, code: int) -> None:
    """SIGTERM, which an agent back in Python acts on; SIGKILL after the grace when it cannot."""
    agent = tmp_path / "torchrun"
    agent.write_text(_AGENT)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(agent), behaviour, _WORKER], stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=25)
    finally:  # a failing case must not leave the stand-in (or its worker) behind
        proc.kill()
        proc.wait()
    assert proc.returncode == code, err
    assert ("did not act on SIGTERM" in err) == (behaviour == "stuck"), err
    assert time.monotonic() - t0 < 20


def test_only_torchrun_is_ended(tmp_path: Path) -> None:
    """A parent that is not torchrun's agent (a shell, another launcher) is never signalled."""
    agent = tmp_path / "launcher"
    agent.write_text(_AGENT.replace("time.sleep(30)", "time.sleep(2)"))
    proc = subprocess.run([sys.executable, str(agent), "stuck", _WORKER], capture_output=True, text=True, timeout=25)
    assert proc.returncode == 0, proc.stderr
