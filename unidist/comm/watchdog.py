"""The per-process watchdog: no wait inside unidist lasts longer than ``UNIDIST_TIMEOUT``.

Engines block inside C with the GIL released (``MPI_Allreduce``, gloo, Horovod's wait, DeepSpeed's bucket
exchange), where no Python timeout can reach them, and a rank that is stopped or spinning elsewhere leaves
its peers there for good. So every place unidist waits on peers is a *watched region*: the primitives of
every engine of 2+ ranks (:func:`watch` wraps the world's engine once, and its sub-engines are wrapped as it
makes them), the waits of async handles, and
the engine calls that exchange gradients inside DeepSpeed and Horovod (:func:`watching`). Entering and
leaving one costs two attribute writes and a clock read (~0.2 us), so it is always on.

A daemon thread wakes a few times per timeout, re-arms Python's GIL-free ``faulthandler`` timer as a backstop
for a main thread stuck in C while holding the GIL (it then dumps every thread's stack and exits 1; this takes
over ``faulthandler.dump_traceback_later`` while a Manager runs), and leaves a heartbeat (time, call number,
current call) in a file of the job's directory on this host. When the main thread has been inside one region
longer than the timeout, it prints which call on which rank (call number, call, shapes), what every rank on
this host was last seen doing (a stale heartbeat is a stopped or dead rank; a rank that left is named) and
ends the job: with the engine's ``abort`` where it has one (MPI_Abort: mpiexec takes every rank down), then
``os._exit``, so torchrun, the deepspeed launcher and horovodrun see a failed worker and stop the others. When
a watched call raises instead (gloo's "Connection reset by peer" after a peer was killed), it names the ranks on
this host whose process is gone, which the engine's error does not (the deepspeed launcher may report the
error of the rank that saw the reset, exit code 1, rather than the killed one's -9). The ranks of other hosts,
whose heartbeat files are not visible here, are asked over the liveness channel (liveness.py). Call
numbers count the watched engine calls, which every rank makes in the same order: the rank with the lower
number is the one behind.
"""

from __future__ import annotations

import datetime
import enum
import faulthandler
import functools
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from unidist.comm import liveness, processes
from unidist.comm.engine import Engine
from unidist.errors import UnidistError

__all__ = ["LEAVING", "TIMEOUT_EXIT_CODE", "describe_args", "engine_timeout", "explaining", "start", "stop",
           "watch", "watching"]

TIMEOUT_EXIT_CODE = 124  # what GNU timeout uses: "the command timed out"
BACKSTOP_GRACE = 15.0  # seconds past the timeout before the GIL-free backstop ends a process (see _Dog.run):
# 2 s fired once in a healthy rank whose watchdog thread was starved while it imported torch._dynamo under load;
# past ENGINE_GRACE, so an engine's own timeout frees a main thread blocked holding the GIL first, and the error
# names the peers (Horovod's enqueue: managers/horovod.py)
ENGINE_GRACE = 10.0  # seconds the engines wait beyond UNIDIST_TIMEOUT: see engine_timeout
LEAVING = "shutdown barrier (this rank is leaving its `with` block while a peer is still in a collective or stuck)"

# the engine primitives of comm/engine.py: every wait on peers goes through one of them
PRIMITIVES = ("barrier", "broadcast", "allreduce", "allgather", "alltoall", "send", "recv", "gather", "scatter",
              "reduce_scatter", "check_exchange", "grouped_allreduce")
ASYNC_PRIMITIVES = ("allreduce_async", "reduce_scatter_async", "broadcast_async", "allgather_async")


class _State:
    """What the main thread is waiting in; written by the main thread, read by the watchdog."""

    __slots__ = ("args", "calls", "depth", "since", "what")

    def __init__(self) -> None:
        self.since = 0.0  # monotonic time the outermost watched region began; 0.0 when none
        self.depth = 0
        self.calls = 0  # watched calls so far: the same sequence on every rank
        self.what = ""
        self.args: tuple[Any, ...] = ()


_state = _State()
_clock = time.monotonic


class _Dog:
    def __init__(self, timeout: float, rank: int, size: int, job: str, abort: Callable[[int], None],
                 address: str | None = None) -> None:
        self.timeout, self.rank, self.size, self.abort = timeout, rank, size, abort
        # several hosts: the liveness channel, bound to this host's cluster address; far: the other hosts' ranks
        self.beacon: liveness.Beacon | None = None
        if address:
            with processes.quiet():  # diagnostics: an address that cannot be bound must not stop training
                self.beacon = liveness.Beacon(address, liveness.job_tag(job))
        self.far: list[liveness.Endpoint] = []
        self.period = min(1.0, timeout / 8)
        self.dir = os.path.join(_HEARTBEATS, f"unidist-{job}")
        try:
            self.me = processes.identity(os.getpid())
        except OSError:  # no /proc: heartbeats still say what each rank does; nobody gets killed
            self.me = f"{os.getpid()}:?@?"
        self.host = socket.gethostname().split(".")[0] or "?"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="unidist-watchdog", daemon=True)

    def run(self) -> None:
        with processes.quiet():
            os.makedirs(self.dir, mode=0o700, exist_ok=True)  # the name is random per job
        while True:
            # the backstop: if this thread cannot run (the main thread holds the GIL inside a blocked C call,
            # as Horovod's enqueue does while its background thread waits for a stopped peer), Python's C-level
            # faulthandler timer, re-armed here, dumps every thread's stack and exits 1
            faulthandler.dump_traceback_later(self.timeout + BACKSTOP_GRACE, exit=True)
            since, calls, what, args = _state.since, _state.calls, _state.what, _state.args
            self.beat(f"at call #{calls} " + (f"waiting in {what}{describe_args(args)}" if since else "computing"))
            if since and _clock() - since > self.timeout and _state.since == since:
                self.fire(calls, what, args, _clock() - since)
                return
            if self.beacon is not None:
                if self.beacon.serve(self.period) or self.stopped.is_set():
                    return
            elif self.stopped.wait(self.period):
                return

    def beat(self, doing: str) -> None:
        """This rank's heartbeat: wall time and what it is doing, replaced atomically."""
        path = os.path.join(self.dir, str(self.rank))
        line = f"{time.time():.3f} {self.me} {self.host} {doing}"
        if self.beacon is not None:
            self.beacon.line = line
        with processes.quiet():
            with open(path + ".tmp", "w") as f:
                f.write(line)
            os.replace(path + ".tmp", path)

    def endpoint(self) -> liveness.Endpoint | None:
        """Where this rank answers probes (None: a job of one host)."""
        if self.beacon is None:
            return None
        return liveness.Endpoint(self.rank, self.host, processes.machine(), self.beacon.sock.getsockname()[0],
                                 self.beacon.port)

    def peers(self) -> tuple[list[str], list[str]]:
        """What each other rank on this host was last seen doing, and the pids of those not responding."""
        out, stuck, now = [], [], time.time()
        for r in range(self.size):
            if r == self.rank:
                continue
            try:
                with open(os.path.join(self.dir, str(r))) as f:
                    stamp, pid, host, doing = f.read().split(" ", 3)
                age = now - float(stamp)
            except (OSError, ValueError):
                continue  # on another host, or never started its watchdog
            if not processes.alive(pid):
                out.append(f"rank {r} has died (its process ended without leaving unidist) on host {host}: last "
                           f"seen {doing}")
            elif age > 3 * self.period + 1:
                out.append(f"rank {r} is not responding (stopped, hung in C or dead) on host {host}: last "
                           f"heartbeat {age:.1f} s ago, {doing}")
                stuck.append(pid)
            else:
                out.append(f"rank {r} is alive {doing}")
        return out + self.far_peers(), stuck

    def far_peers(self) -> list[str]:
        """What the ranks of other hosts answer over the liveness channel (see liveness.py), and whether this
        host is the one cut off. The watchdog thread keeps answering its own peers while it asks."""
        if not self.far:
            return []
        own = threading.current_thread() is self.thread
        return liveness.describe(self.far, self.beacon.tag if self.beacon else "", self.host,
                                 self.beacon.sock.getsockname()[0] if self.beacon else "",
                                 serving=self.beacon if own else None)

    def fire(self, calls: int, what: str, args: tuple[Any, ...], waited: float) -> None:
        peers, stuck = self.peers()
        seen = ("; ".join(peers) + ".") if peers else "no other rank's heartbeat is visible on this host."
        print(f"unidist: rank {self.rank} of {self.size}: call #{calls} {what}{describe_args(args)} has waited "
              f"{waited:.1f} s, longer than UNIDIST_TIMEOUT={self.timeout:g}. {seen} Another rank is stuck, dead, "
              "exited or made a different call; ending the job. Raise UNIDIST_TIMEOUT if the wait is "
              "legitimate.", file=sys.stderr, flush=True)
        for pid in stuck:
            processes.kill(pid)
        if self.beacon is not None:  # peers probing now learn this rank is alive and why it ends the job
            self.beacon.line = (f"{time.time():.3f} {self.me} {self.host} ending the job: call #{calls} {what} "
                                "timed out")
        pause = self.beacon.serve if self.beacon is not None else time.sleep  # peers probing still get an answer
        processes.end_job(self.abort, TIMEOUT_EXIT_CODE, pause,
                          cut_off=any(liveness.LINK_LOST in p for p in peers))

    def failed(self, calls: int, what: str, args: tuple[Any, ...], exc: BaseException) -> None:
        """A watched call raised. When a peer was killed, the engine's error names no rank (gloo: "Connection
        reset by peer", MPI: a lost connection), so say which rank on this host died or stopped responding.
        The peer's process may still be exiting when its closed socket reaches us: look a few times."""
        for attempt in range(FAILED_LOOKS):
            peers = [p for p in self.peers()[0] if " is alive " not in p]
            if peers:
                print(f"unidist: rank {self.rank} of {self.size}: call #{calls} {what}{describe_args(args)} failed "
                      f"({type(exc).__name__}): {'; '.join(peers)}.", file=sys.stderr, flush=True)
                return
            if attempt + 1 < FAILED_LOOKS:
                time.sleep(0.1)

    def leave(self) -> None:
        self.stopped.set()
        if self.beacon is not None:
            self.beacon.wake()
        self.thread.join(timeout=5)
        if self.beacon is not None:
            self.beacon.close()
        faulthandler.cancel_dump_traceback_later()
        with processes.quiet():
            os.remove(os.path.join(self.dir, str(self.rank)))
            os.rmdir(self.dir)  # the last rank out removes the directory


_HEARTBEATS = tempfile.gettempdir()


_dog: _Dog | None = None


def engine_timeout(timeout: float) -> datetime.timedelta:
    """The timeout handed to an engine (gloo, torch's store): a little longer than the watchdog's, so the
    watchdog, which names the call and the ranks, fires first; the engine's own error is the fallback."""
    return datetime.timedelta(seconds=timeout + ENGINE_GRACE)


def start(timeout: float, rank: int, size: int, job: str, abort: Callable[[int], None], *,
          address: str | None = None, exchange: Callable[[Any], list[Any]] | None = None) -> None:
    """Start this process's watchdog (one per process; a second start replaces the first). ``job`` is the
    same string on every rank of the job and differs between jobs: it names the heartbeat directory;
    ``abort`` is the engine's (``Engine.abort``), called before this process exits on a timeout.

    A job of several hosts also passes ``address``, this host's cluster address, where the watchdog answers
    probes from the other hosts, and ``exchange``, an allgather of one object per rank (every rank calls
    ``start`` together then), by which the ranks learn where the others answer."""
    global _dog
    stop()
    _state.since, _state.depth, _state.calls = 0.0, 0, 0
    _dog = _Dog(timeout, rank, size, job, abort, address)
    _dog.thread.start()
    if exchange is not None:
        table = exchange(_dog.endpoint())  # a watched call: a rank that never arrives is caught as any other
        here = processes.machine()
        _dog.far = [liveness.Endpoint(*e) for e in table if e is not None and e[2] != here]
        _state.calls = 0


def stop() -> None:
    """Stop the watchdog and remove this rank's heartbeat (at shutdown)."""
    global _dog
    if _dog is not None:
        _dog.leave()
        _dog = None


# times, 0.1 s apart, a failed watched call looks for a dead peer (see _Dog.failed): only errors pay for it
FAILED_LOOKS = 5


def calls() -> int:
    """Watched engine calls this process has made so far (every collective and point-to-point primitive of
    unidist's engines, and the engine regions DeepSpeed and Horovod exchange gradients in): a test or a
    benchmark reads the difference to count communication."""
    return _state.calls


@contextmanager
def watching(what: str, *args: Any) -> Iterator[None]:
    """A watched region around an engine call that waits on peers (a gradient exchange, an engine's start)."""
    st = _state
    st.calls += 1
    outer = st.depth == 0
    if outer:
        st.what, st.args, st.since = what, args, _clock()
    st.depth += 1
    try:
        yield
    except Exception as exc:
        if outer:
            _explain(exc)
        raise
    finally:
        st.depth -= 1
        if outer:
            st.since, st.args = 0.0, ()


@contextmanager
def explaining(what: str) -> Iterator[None]:
    """An engine call that should not wait on peers but can (Horovod's enqueue in a backward hook, see
    managers/horovod.py): not timed, as computing happens inside it, but an engine error leaving it names the
    peers that died or stopped, as one leaving a watched region does."""
    try:
        yield
    except Exception as exc:
        if _state.depth == 0 and _dog is not None and not isinstance(exc, UnidistError):
            _dog.failed(_state.calls, what, (), exc)
        raise


def _explain(exc: Exception) -> None:
    """An engine error left the outermost watched region: name the peers that died, unless unidist raised it
    on purpose (a typed error: bad input, a detected mismatch), which says what it needs to."""
    if _dog is not None and not isinstance(exc, UnidistError):
        _dog.failed(_state.calls, _state.what, _state.args, exc)


def _watched(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    st = _state

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        st.calls += 1
        if st.depth:
            return fn(*args)
        st.what, st.args, st.since = what, args, _clock()
        st.depth = 1
        try:
            return fn(*args)
        except Exception as exc:
            _explain(exc)
            raise
        finally:
            st.depth, st.since, st.args = 0, 0.0, ()
    return call


class _WatchedWork:
    __slots__ = ("_args", "_what", "_work")

    def __init__(self, work: Any, what: str, args: tuple[Any, ...]) -> None:
        self._work, self._what, self._args = work, what, args

    def wait(self) -> None:
        with watching(self._what, *self._args):
            self._work.wait()

    def test(self) -> bool:
        return bool(self._work.test())


def _watched_async(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    # the start is watched too: an engine without a native async call runs the blocking primitive right here
    # (Engine's derived defaults), so a peer that never arrives must be caught in the start as in the wait
    start, waiting = _watched(fn, what), what + " wait"

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        return _WatchedWork(start(*args), waiting, args)
    return call


class _WatchedEngine:
    """An engine whose every wait on peers is a watched region; everything else is the engine's own. Its
    sub-engines (groups) are watched alike, their calls named ``group <call>``."""

    def __init__(self, engine: Any, where: str) -> None:
        self._inner, self._where = engine, where
        for name in PRIMITIVES:  # instance attributes: a call costs what the engine's own method does, plus ~0.1 us
            setattr(self, name, _watched(getattr(engine, name), where + name))
        for name in ASYNC_PRIMITIVES:
            setattr(self, name, _watched_async(getattr(engine, name), where + name.removesuffix("_async")))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sub(self, lists: Any) -> list[Any]:
        return [e if e is None or e.size < 2 else _WatchedEngine(e, "group ") for e in self._inner.sub(lists)]


def watch(engine: Engine) -> Engine:
    """``engine`` (of 2+ ranks) with every primitive a watched region, and its sub-engines too: wrapped once,
    when the Manager makes it."""
    return cast("Engine", _WatchedEngine(engine, ""))


def describe_args(args: tuple[Any, ...]) -> str:
    """``(float32[4], op=sum)``: tensors by dtype and shape, small values as they are."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}")
        elif isinstance(a, enum.Enum):  # a ReduceOp
            parts.append(f"op={a.value}")
        elif isinstance(a, (int, float, str)) or a is None:
            parts.append(repr(a))
        elif isinstance(a, (list, tuple)) and len(a) <= 8:
            parts.append(repr(list(a)))
        else:
            parts.append(type(a).__name__)
    return f"({', '.join(parts)})" if parts else ""
