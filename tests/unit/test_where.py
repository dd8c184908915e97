"""Messages name the user's own line and look before a short timeout (issue 40): the user's file and line read
off the waiting thread's stack (regions.user_line, regions.waiter), in the heartbeat's position and the
inspector's words, and the watchdog's first look at a wait when UNIDIST_TIMEOUT is short against
UNIDIST_STALL_WARNING (a desync ends the job before the timeout; a timeout's message carries the verdict)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import pytest
import torch

from unidist.comm import processes, regions, stall, watchdog
from unidist.comm.engine import SoloEngine
from unidist.ops import ReduceOp

HERE = os.path.relpath(__file__)


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno


class _Pair(SoloEngine):
    """Two ranks whose allreduce runs ``during`` (or sleeps ``seconds``) inside the watched call."""

    def __init__(self, seconds: float = 0.0, during: Any = None) -> None:
        super().__init__()
        self.size, self.seconds, self.during = 2, seconds, during
        self.seen: list[Any] = []

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        if self.during is not None:
            self.seen.append(self.during())
        time.sleep(self.seconds)


def test_the_users_line_is_the_first_frame_outside_unidist() -> None:
    engine = regions.watch(_Pair(during=lambda: regions.user_line(sys._getframe())))
    t = torch.ones(4)
    line = _line() + 1
    engine.allreduce(t, t, ReduceOp.SUM)  # the engine's own frame (this file) is inside unidist's: skipped
    assert engine._inner.seen == [f"{HERE}:{line}"]
    assert regions.user_line(sys._getframe()) == ""  # no unidist frame on the stack: nothing to name


@pytest.mark.parametrize("on_main", [True, False])
def test_the_watchdog_thread_reads_the_line_of_the_thread_that_waits(on_main: bool) -> None:
    """From another thread, as the watchdog reads it: the thread inside a watched call, main or not."""
    inside, leave = threading.Event(), threading.Event()
    engine = regions.watch(_Pair(during=lambda: (inside.set(), leave.wait(10))))
    t = torch.ones(4)
    got: list[str] = []

    def read() -> None:
        inside.wait(10)
        got.append(regions.user_line(regions.waiter()))
        leave.set()

    def call() -> None:
        engine.allreduce(t, t, ReduceOp.SUM)

    line = call.__code__.co_firstlineno + 1
    here, there = (call, read) if on_main else (read, call)
    other = threading.Thread(target=there)
    other.start()
    here()
    other.join(10)
    assert got == [f"{HERE}:{line}"]


def test_a_position_carries_the_line_and_the_inspector_says_it() -> None:
    seen: list[dict[str, Any]] = []
    engine = regions.watch(_Pair(during=lambda: seen.append(regions.position((regions.waiting().token, "a.py:7")))))
    regions.reset(2)
    t = torch.ones(4)
    engine.allreduce(t, t, ReduceOp.SUM)
    call = seen[0]["call"]
    assert call["at"] == "a.py:7" and call["on"] == "world" and call["n"] == 1
    assert regions.position((regions.waiting().token, "a.py:7"))["call"] is None  # computing: no line
    verdict = stall.classify(0, 2, seen[0], [stall.Seen(1, "h1", position={"seqs": {"world": 2}, "call": None})])
    assert verdict.text() == ("rank 0 is waiting in allreduce(float32[4], float32[4], op=sum) at a.py:7 (collective #1 "
                              "of all ranks); rank 1 on host h1 is computing, already past collective #1 of all ranks "
                              "(it has made 2 collectives of all ranks)")


def test_places_are_said_in_plain_words() -> None:
    assert stall.place("world", 5) == "collective #5 of all ranks"
    assert stall.place("group 0,2#0", 2) == "collective #2 of the group of ranks 0,2"
    assert stall.place("group 0,2#1", 2) == "collective #2 of the 2nd group of ranks 0,2"
    assert stall.place(regions.REGIONS, 1) == "exchange #1 of all ranks"
    assert stall.made("world", 1) == "1 collective of all ranks"
    assert stall.made(regions.REGIONS, 3) == "3 exchanges of all ranks"
    assert "desync" not in regions.CHECK and "region" not in watchdog.LEAVING


def _peer(directory: str, pos: dict[str, Any], stop: threading.Event) -> None:
    """Rank 1's heartbeat at ``pos``, kept fresh until ``stop``."""
    os.makedirs(directory, exist_ok=True)
    while not stop.is_set():
        with open(os.path.join(directory, "1"), "w") as f:
            f.write(f"{time.time():.3f} {processes.identity(os.getpid())} h1 computing\t{json.dumps(pos)}")
        stop.wait(0.1)


def _wait_in_allreduce(tmp_path: object, monkeypatch: pytest.MonkeyPatch, seconds: float, timeout: float,
                       peer: dict[str, Any]) -> tuple[list[int], float, int]:
    """This rank (0 of 2) waits ``seconds`` in an allreduce under a watchdog of ``timeout`` and the default
    UNIDIST_STALL_WARNING while rank 1's heartbeat says ``peer``: the codes the job was ended with, when the first
    came (seconds into the wait) and the allreduce's line."""
    monkeypatch.setattr(watchdog, "_HEARTBEATS", str(tmp_path))
    ended: list[tuple[int, float]] = []
    monkeypatch.setattr(processes, "end_job", lambda abort, code, pause=None, **kw: ended.append((code, time.time())))
    engine = regions.watch(_Pair(seconds))
    watchdog.start(timeout, 0, 2, "job", lambda code: None, stall_warning=60.0)
    stop = threading.Event()
    beater = threading.Thread(target=_peer, args=(os.path.join(str(tmp_path), "unidist-job"), peer, stop))
    beater.start()
    try:
        t = torch.ones(4)
        began, line = time.time(), _line() + 1
        engine.allreduce(t, t, ReduceOp.SUM)
    finally:
        stop.set()
        beater.join()
        watchdog.stop()
    return [c for c, _ in ended], (ended[0][1] - began if ended else 0.0), line


def test_a_desync_ends_the_job_before_a_timeout_shorter_than_the_warning(
        tmp_path: object, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """UNIDIST_TIMEOUT=4 under the default 60 s warning: the inspector looks at a quarter of the timeout, and the
    skipped collective (rank 1 already past it) ends the job with its verdict, not the timeout's."""
    codes, after, line = _wait_in_allreduce(tmp_path, monkeypatch, 3.5, 4.0, {"seqs": {"world": 3}, "call": None})
    err = capfd.readouterr().err
    assert codes == [watchdog.DESYNC_EXIT_CODE], err
    assert after < 3.0, f"ended {after:.1f} s into the wait\n{err}"
    assert ("unidist: rank 0 of 2: unidist.errors.CollectiveMismatchError: ranks are in different calls: a rank "
            f"skipped, added or reordered a collective: rank 0 is waiting in allreduce(float32[4], float32[4], "
            f"op=sum) at {HERE}:{line} (collective #1 of all ranks); rank 1 on host h1 is computing, already past "
            "collective #1 of all ranks (it has made 3 collectives of all ranks)") in err, err
    assert "UNIDIST_TIMEOUT" not in err and "stalled for" not in err, err


def test_a_timeout_says_the_inspectors_verdict_and_the_users_line(
        tmp_path: object, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A straggler past a 1 s UNIDIST_TIMEOUT: the early look keeps quiet (below the warning), the timeout says
    why in the inspector's words."""
    codes, _, line = _wait_in_allreduce(tmp_path, monkeypatch, 2.0, 1.0, {"seqs": {"world": 0}, "call": None})
    err = capfd.readouterr().err
    assert codes == [watchdog.TIMEOUT_EXIT_CODE], err
    assert err.count("unidist: ") == 1 and "stalled for" not in err, err
    assert (f"unidist: rank 0 of 2: allreduce(float32[4], float32[4], op=sum) at {HERE}:{line} has waited ") in err, err
    assert ("longer than UNIDIST_TIMEOUT=1: a rank this call needs has not arrived: it is still computing (a "
            f"straggler): rank 0 is waiting in allreduce(float32[4], float32[4], op=sum) at {HERE}:{line} (collective "
            "#1 of all ranks); rank 1 on host h1 is computing, not yet at collective #1 of all ranks (it has made 0 "
            "collectives of all ranks). Ending the job; raise UNIDIST_TIMEOUT if the wait is legitimate.") in err, err


def test_arguments_are_said_as_the_user_knows_them() -> None:
    """Tensors by dtype and shape, lists of them too (grouped calls); an engine's prepared arguments (MPI's buffer,
    count and datatype) are left out rather than printed as objects."""
    t = torch.ones(4)
    assert regions.describe_args((t, [object(), 4, object()], ReduceOp.SUM)) == "(float32[4], op=sum)"
    assert regions.describe_args(([t, torch.ones(2, 3, dtype=torch.float64)], ReduceOp.SUM, True)) == \
        "([float32[4], float64[2, 3]], op=sum, True)"
    assert regions.describe_args(([t] * 6,)) == "([float32[4], float32[4], float32[4], float32[4], ... (6 tensors)])"
    assert regions.describe_args((t, [1, 2], None)) == "(float32[4], [1, 2], None)"
