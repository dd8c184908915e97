"""The stall inspector: positions as the watched regions record them, the classification of stalls (stall.py),
and the watchdog thread acting on it (a desync seen twice ends the job; other kinds warn)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest
import torch

from unidist.comm import processes, regions, stall, watchdog
from unidist.comm.engine import Engine, SoloEngine
from unidist.comm.stall import Seen, classify
from unidist.ops import ReduceOp


def _pos(seqs: dict[str, int], on: str | None = None, n: int = 0, kind: str = "allreduce",
         sig: str = "allreduce float32 4 op=sum", peer: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] | None = None
    if on is not None:
        call = {"kind": kind, "args": "(float32[4])", "sig": sig, "on": on, "n": n}
    elif peer is not None:
        call = {"kind": kind, "args": "(float32[4])", "sig": sig, "peer": peer}
    return {"seqs": seqs, "call": call}


ME = _pos({"world": 5}, "world", 5)


def _alive(rank: int, pos: dict[str, Any] | None) -> Seen:
    return Seen(rank, "h1", position=pos)


def test_members_of_the_world_and_of_a_group() -> None:
    assert stall.members("world", 3) == (0, 1, 2)
    assert stall.members("regions", 2) == (0, 1)
    assert stall.members("group 0,2#1", 4) == (0, 2)


@pytest.mark.parametrize(("other", "kind"), [
    (_pos({"world": 4}), "straggler"),  # computing, one call behind
    (_pos({"world": 5}, "world", 5), "engine"),  # the same call: inside the engine
    (_pos({"world": 6}), "desync"),  # already past this call: it skipped what this rank waits in
    (_pos({"world": 5}), "desync"),  # entered call 5 and left it while this rank still waits there
    (_pos({"world": 5, "regions": 2}, "regions", 2, watchdog.LEAVING), "desync"),  # left: its barrier is #5
    (_pos({"world": 5}, "world", 5, "broadcast", "broadcast float32 4 root=0"), "desync"),  # another call there
    (_pos({"world": 5}, "world", 5, sig="allreduce float32 4 op=max"), "desync"),  # the op differs
    (_pos({"world": 4, "group 1,2#0": 3}, "group 1,2#0", 3), "blocked"),  # waits on ranks this one does not
    (_pos({"world": 3, "regions": 2}, "regions", 2, "deepspeed engine.step"), "desync"),  # a region not reached
    (_pos({"world": 4}, peer=0, kind="recv"), "desync"),  # waits on this rank, which is in a collective
    (_pos({"world": 4}, peer=2, kind="recv"), "blocked"),
    (None, "unknown"),  # nothing visible: no verdict, and never a desync
])
def test_a_rank_of_the_world_is_judged_by_where_it_is(other: dict[str, Any] | None, kind: str) -> None:
    mine = dict(ME, seqs={"world": 5, "regions": 1})
    verdict = classify(0, 2, mine, [_alive(1, other)])
    assert verdict.kind == kind, verdict.text()
    assert verdict.lines[0] == "rank 0 is waiting in allreduce(float32[4]) (collective #5 of all ranks)"


def test_a_gone_rank_is_named_in_the_watchdogs_words_and_outranks_a_straggler() -> None:
    dead = Seen(2, "h2", "dead", why="rank 2 has died (its process is gone: connection refused) on host h2")
    verdict = classify(0, 3, ME, [_alive(1, _pos({"world": 4})), dead])
    assert verdict.kind == "gone"
    assert verdict.lines[1] == dead.why
    assert "rank 1 on host h1 is computing, not yet at collective #5 of all ranks" in verdict.text()


def test_desync_outranks_every_other_kind() -> None:
    stopped = Seen(1, "h1", "stopped", why="rank 1 is not responding")
    verdict = classify(0, 3, ME, [stopped, _alive(2, _pos({"world": 7}))])
    assert verdict.kind == "desync" and ("already past collective #5 of all ranks (it has made 7 collectives "
                                        "of all ranks)") in verdict.text()


def test_only_the_ranks_the_call_needs_count() -> None:
    """A rank outside the group this rank waits in may be anywhere: it neither delays nor desyncs the call."""
    mine = _pos({"world": 9, "group 0,1#0": 2}, "group 0,1#0", 2)
    inside = _alive(1, _pos({"world": 9, "group 0,1#0": 2}, "group 0,1#0", 2))
    outside = _alive(2, _pos({"world": 30}))
    assert classify(0, 3, mine, [inside, outside]).kind == "engine"
    # a second group of the very same members is another engine: its numbers are its own
    other = _alive(1, _pos({"world": 9, "group 0,1#0": 2, "group 0,1#1": 5}, "group 0,1#1", 5))
    assert classify(0, 3, mine, [other, outside]).kind == "desync"  # rank 1 waits where rank 0 has not been


def test_a_rank_blocked_in_a_group_this_rank_is_outside_is_not_a_desync() -> None:
    other = _alive(1, _pos({"world": 4, "group 1,2#0": 8}, "group 1,2#0", 8))
    assert classify(0, 3, ME, [other]).kind == "blocked"


@pytest.mark.parametrize(("other", "kind"), [
    (_pos({}, peer=0, kind="send"), "engine"),  # the matching send: the transfer is in the engine
    (_pos({}, peer=0, kind="recv"), "desync"),  # both receive from each other
    (_pos({"world": 3}), "straggler"),
    (_pos({"world": 3}, "world", 3), "desync"),  # it waits in a collective this rank has not reached
    (_pos({"world": 2}, "world", 2), "desync"),  # ... one this rank has passed: it cannot complete
    (_pos({"world": 1, "group 1,2#0": 1}, "group 1,2#0", 1), "blocked"),  # a group this rank is outside
])
def test_point_to_point_is_judged_against_its_peer(other: dict[str, Any], kind: str) -> None:
    mine = _pos({"world": 2}, peer=1, kind="recv")
    verdict = classify(0, 3, mine, [_alive(1, other), _alive(2, _pos({"world": 40}))])
    assert verdict.kind == kind, verdict.text()


def test_a_rank_that_is_not_waiting_has_no_stall() -> None:
    assert classify(0, 2, _pos({"world": 3}), [_alive(1, _pos({"world": 3}))]).kind == "unknown"


class _Pair(SoloEngine):
    """Two ranks whose primitives are a solo engine's; ``during`` runs inside allreduce (to read the position
    the main thread shows while it waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 2
        self.during: list[dict[str, Any]] = []

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        self.during.append(regions.position())

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self.during.append(regions.position())

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        return [_Pair() if 0 in m else None for m in lists]


def test_positions_number_each_engine_apart() -> None:
    inner = _Pair()
    inner.size = 3
    engine = regions.watch(inner)
    regions.reset(3)
    t = torch.ones(4)
    engine.allreduce(t, t, ReduceOp.SUM)
    engine.broadcast(t, 0)
    subs = engine.sub([[0, 1], [1, 2], [0, 1]])
    assert subs[1] is None
    subs[2].allreduce(t, t, ReduceOp.MAX)
    engine.allreduce(t, t, ReduceOp.SUM)
    engine.send(t, 1, 0)
    first, group, again, p2p = inner.during[0], subs[2]._inner.during[0], inner.during[1], inner.during[2]
    assert first["call"] == {"kind": "allreduce", "args": "(float32[4], float32[4], op=sum)",
                             "sig": "allreduce float32 4 op=sum", "on": "world", "n": 1}
    # the third list repeats the first's members: another engine, numbered apart (#1)
    assert group["call"]["on"] == "group 0,1#1" and group["call"]["n"] == 1
    assert group["seqs"]["world"] == 2 and group["seqs"]["group 0,1#1"] == 1 and "group 0,1#0" not in group["seqs"]
    assert again["call"]["n"] == 3 and again["seqs"]["group 0,1#1"] == 1
    assert p2p["call"]["peer"] == 1 and "on" not in p2p["call"] and p2p["seqs"]["world"] == 3
    assert regions.position()["call"] is None  # left every call


def _heartbeat(directory: str, rank: int, pos: dict[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, str(rank)), "w") as f:
        f.write(f"{time.time():.3f} {processes.identity(os.getpid())} h1 computing\t{json.dumps(pos)}")


class _Slow(_Pair):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        time.sleep(self.seconds)


@pytest.mark.parametrize(("peer", "ends"), [(_pos({"world": 3}), True), (_pos({"world": 0}), False)])
def test_the_watchdog_ends_a_desync_and_warns_of_a_straggler(tmp_path: object, peer: dict[str, Any], ends: bool,
                                                            capfd: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank past the call this one waits in (a skipped collective) ends the job with the typed error's name
    after two samples; a rank behind is a straggler, warned about and left to UNIDIST_TIMEOUT."""
    monkeypatch.setattr(watchdog, "_HEARTBEATS", str(tmp_path))
    ended: list[int] = []
    monkeypatch.setattr(processes, "end_job", lambda abort, code, pause=None: ended.append(code))
    engine = regions.watch(_Slow(3.0))
    watchdog.start(60.0, 0, 2, "job", lambda code: None, stall_warning=0.6)
    stop = threading.Event()

    def beat() -> None:  # the peer's heartbeat, kept fresh
        while not stop.is_set():
            _heartbeat(os.path.join(str(tmp_path), "unidist-job"), 1, peer)
            stop.wait(0.2)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        t = torch.ones(4)
        engine.allreduce(t, t, ReduceOp.SUM)
    finally:
        stop.set()
        beater.join()
        watchdog.stop()
    err = capfd.readouterr().err
    if ends:
        assert ended == [watchdog.DESYNC_EXIT_CODE]
        assert "unidist.errors.CollectiveMismatchError: ranks are in different calls" in err
        assert ("rank 1 on host h1 is computing, already past collective #1 of all ranks (it has made 3 collectives of "
                "all ranks)") in err
    else:
        assert ended == []
        assert "a rank this call needs has not arrived: it is still computing (a straggler)" in err
        assert ("rank 1 on host h1 is computing, not yet at collective #1 of all ranks (it has made 0 collectives of "
                "all ranks)") in err


def test_a_rank_stopped_just_after_a_call_is_not_taken_for_one_that_never_left(
        tmp_path: object, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its last heartbeat, written before this rank's wait began, still shows the call both ranks left: only a
    heartbeat written during the wait says where a rank is. It is called stopped once the heartbeat is stale."""
    monkeypatch.setattr(watchdog, "_HEARTBEATS", str(tmp_path))
    ended: list[int] = []
    monkeypatch.setattr(processes, "end_job", lambda abort, code, pause=None: ended.append(code))
    engine = regions.watch(_Slow(3.0))
    watchdog.start(60.0, 0, 2, "job", lambda code: None, stall_warning=0.6)
    try:
        # rank 1 was seen inside the world's first call, then stopped: this rank's wait is the world's second
        engine.barrier()
        _heartbeat(os.path.join(str(tmp_path), "unidist-job"), 1, _pos({"world": 1}, "world", 1, "barrier", "barrier"))
        t = torch.ones(4)
        engine.allreduce(t, t, ReduceOp.SUM)
    finally:
        watchdog.stop()
    err = capfd.readouterr().err
    assert ended == [] and "CollectiveMismatchError" not in err, err
    assert "a rank this call needs is gone" in err and "rank 1 is not responding (stopped" in err, err
