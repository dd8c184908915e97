"""The composition: one Communicator over an Engine, groups over sub-engines, the watchdog wrapping an engine
once and ending the job through the engine's own abort."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

import pytest
import torch

import unidist
from unidist.comm import processes, watchdog
from unidist.comm.communicator import Communicator
from unidist.comm.engine import Engine, SoloEngine
from unidist.comm.group import Group
from unidist.ops import ReduceOp


class _Pair(SoloEngine):
    """A stand-in engine of two ranks (its primitives are a solo engine's), to see what wraps it."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 2
        self.aborted: list[int] = []

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        return [_Pair() for _ in lists]

    def abort(self, code: int) -> None:
        self.aborted.append(code)


def test_manager_and_groups_are_one_communicator_class() -> None:
    with unidist.init(environ={}) as mgr:
        assert isinstance(mgr, Communicator) and isinstance(mgr.engine, SoloEngine)
        g = mgr.new_group([0])
        assert type(g) is Group and isinstance(g.engine, SoloEngine) and g.engine is not mgr.engine
    from unidist.engines.horovod import manager as horovod
    from unidist.engines.mpi import manager as mpi
    from unidist.engines.torch import manager as torch_manager

    for module in (mpi, torch_manager, horovod):
        made = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
        assert not [c for c in made if issubclass(c, Group)], f"{module.__name__} subclasses Group"
        assert [c for c in made if issubclass(c, Engine)], f"{module.__name__} has no Engine"


def test_watch_wraps_the_engine_once_and_its_sub_engines() -> None:
    inner = _Pair()
    engine = watchdog.watch(inner)
    t = torch.ones(2)
    calls = watchdog.calls()
    engine.allreduce(t, t, ReduceOp.SUM)
    assert watchdog.calls() == calls + 1
    assert engine.rank == 0 and engine.size == 2 and engine.upcast_reduce is inner.upcast_reduce
    subs: Sequence[Engine | None] = engine.sub([[0, 1], [0]])
    assert type(subs[0]).__name__ == "_WatchedEngine" and isinstance(subs[1], SoloEngine)


def test_a_timeout_ends_the_job_through_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    inner = _Pair()
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(processes, "ABORT_GRACE", 0.0)
    processes.end_job(inner.abort, watchdog.TIMEOUT_EXIT_CODE)
    assert inner.aborted == exits == [watchdog.TIMEOUT_EXIT_CODE]


class _Lost(_Pair):
    """An engine whose allreduce fails as gloo's does when the peer was killed (a reset connection)."""

    def allreduce(self, *args: object) -> None:
        raise RuntimeError("Read error [127.0.0.1]:1: Connection reset by peer")

    def broadcast(self, *args: object) -> None:
        raise unidist.errors.InvalidArgumentError("bad root")


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


def _peer_heartbeat(tmp_path: object, pid: int, doing: str) -> None:
    """Rank 1's heartbeat in job ``job``'s directory, written as its watchdog would, for process ``pid``."""
    beat = os.path.join(str(tmp_path), "unidist-job", "1")
    os.makedirs(os.path.dirname(beat), exist_ok=True)
    with open(beat, "w") as f:
        f.write(f"{__import__('time').time():.3f} {processes.identity(pid)} {doing}")


def test_a_failed_call_names_the_peer_that_died(tmp_path: object, capfd: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's error names no rank; the watchdog names the one whose process is gone (a real process,
    killed), and says nothing when the peer lives or when unidist raised a typed error on purpose."""
    import subprocess
    import sys

    monkeypatch.setattr(watchdog, "_HEARTBEATS", str(tmp_path))
    engine = watchdog.watch(_Lost())
    t = torch.ones(2)
    watchdog.start(60.0, 0, 2, "job", lambda code: None)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # its last heartbeat had it computing after its first collective
        _peer_heartbeat(tmp_path, peer.pid, 'hostA computing\t{"seqs":{"world":1},"call":null}')
        with pytest.raises(RuntimeError, match="reset"):
            engine.allreduce(t, t, ReduceOp.SUM)
        assert "failed" not in capfd.readouterr().err  # the peer lives: the engine's error stands alone
        identity = processes.identity(peer.pid)
        peer.kill()
        peer.wait()
        # a pid read on another host (a heartbeat directory several hosts share) says nothing here
        assert not processes.alive(identity) and processes.alive(identity.replace("@", "@elsewhere-"))
        with pytest.raises(unidist.errors.InvalidArgumentError):
            engine.broadcast(t, 0)
        assert "failed" not in capfd.readouterr().err
        line = _line() + 2  # the call's own line: the message names it
        with pytest.raises(RuntimeError, match="reset"):
            engine.allreduce(t, t, ReduceOp.SUM)
        err = capfd.readouterr().err
        here = os.path.relpath(__file__)
        assert f"rank 0 of 2: allreduce(float32[2], float32[2], op=sum) at {here}:{line} failed (RuntimeError)" \
            in err and "rank 1 has died" in err and "on host hostA" in err, err
        # not "last seen" there: it died within a heartbeat's period of it, after more calls (this rank made 3)
        assert re.search(r"its last heartbeat, [\d.]+ s ago \(one every 1 s while it lived\), had it computing, "
                         r"having made 1 collective of all ranks; this rank has made 3\b", err), err
    finally:
        peer.kill()
        watchdog.stop()


def test_an_error_leaving_an_explained_region_names_the_dead_peer(tmp_path: object,
                                                                  capfd: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``explaining`` (Horovod's backward, whose enqueue can block until Horovod's own timeout) is not timed,
    but an engine error leaving it names the peers as a watched call's does; a typed error stays alone."""
    import subprocess
    import sys

    monkeypatch.setattr(watchdog, "_HEARTBEATS", str(tmp_path))
    watchdog.start(60.0, 0, 2, "job", lambda code: None)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _peer_heartbeat(tmp_path, peer.pid, "hostB computing")
        peer.kill()
        peer.wait()
        with pytest.raises(unidist.errors.InvalidArgumentError), watchdog.explaining("hvd backward"):
            raise unidist.errors.InvalidArgumentError("bad")
        assert "failed" not in capfd.readouterr().err
        line = _line() + 1
        with pytest.raises(RuntimeError, match="shut down"), watchdog.explaining("hvd backward"):
            raise RuntimeError("Horovod has been shut down")
        err = capfd.readouterr().err
        here = os.path.relpath(__file__)
        assert f"rank 0 of 2: hvd backward at {here}:{line} failed (RuntimeError): rank 1 has died" in err, err
        assert "on host hostB" in err, err
    finally:
        peer.kill()
        watchdog.stop()
