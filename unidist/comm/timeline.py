"""The timeline (``UNIDIST_TIMELINE=path``): every engine call of every rank, on one Chrome/Perfetto trace.

When the variable is set, the Manager wraps its engine in a *recording engine* before the watchdog wraps it
(so the watchdog's timing and counting see the same calls): every primitive comm/primitives.py declares
becomes one complete event with its start, duration, bytes, dtype, op, group and peer, each async start a
``<call> launch`` event and its handle's ``wait()`` a ``<call> wait`` event with the same ``id``. Sub-engines
(groups) are recorded alike, named by their ranks. The layers above add spans through comm/trace_hooks.py
(backward, step, bucket launches and waits, ZeRO gathers, pipeline sends; :func:`watching` for DeepSpeed's and
Horovod's own exchanges). When the variable is unset nothing is wrapped: the fast path is untouched.

Events are kept in memory (at most ``UNIDIST_TIMELINE_EVENTS`` a rank; the rest are counted and dropped) and
written at shutdown by comm/trace_files.py: per-rank parts, clocks aligned, merged by rank 0 into ``path``.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, cast

import torch

from unidist.comm import processes, regions, trace_files, trace_hooks
from unidist.comm.engine import Engine
from unidist.comm.primitives import ASYNC, EXCHANGES, TIMELINE, WATCHED, serves
from unidist.ops import ReduceOp

__all__ = ["Recorder", "abandon", "active", "align", "current", "describe", "finish", "recorded_call", "recording",
           "watching"]

_clock = time.monotonic_ns  # CLOCK_MONOTONIC: one clock for every process of a host (trace_files aligns hosts)


def active() -> bool:
    """Whether this process records a timeline now."""
    return trace_hooks.active


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def describe(name: str, args: Sequence[Any], group: str, n: int) -> dict[str, Any]:
    """An engine call's event arguments: bytes (nccl-tests' size), dtype, op, group, its size n, peer/root.
    The common primitives by :data:`_FAST`'s positions; gather and scatter take the larger buffer (root 4th),
    grouped_allreduce sums its list, the desync check moves three int64."""
    base = serves(name)
    if name in _FAST:
        return trace_files.call_args(_summarizer(name, group, n)(tuple(args), -1))
    out: dict[str, Any] = {"group": group, "n": n, "bytes": 0}
    t = None
    if base in ("gather", "scatter"):
        t = max((a for a in args[:2] if isinstance(a, torch.Tensor)), key=_nbytes, default=None)
        if len(args) > 3 and isinstance(args[3], int):
            out["root"] = args[3]
    elif base == "grouped_allreduce" and args:
        t = args[0][0] if len(args[0]) else None
        out["bytes"] = sum(_nbytes(x) for x in args[0])
    elif base == "check_exchange":  # three int64 words; its arguments name the call it checks (check.py)
        out["bytes"] = 24
        return out
    if isinstance(t, torch.Tensor):
        out["bytes"] = out["bytes"] or _nbytes(t)
        out["dtype"] = str(t.dtype).removeprefix("torch.")
    for a in args:
        if isinstance(a, ReduceOp):
            out["op"] = a.value
            break
    return out


class _Span:
    __slots__ = ("args", "kind", "rec", "start", "stream")

    def __init__(self, rec: Recorder, kind: str, stream: str, args: dict[str, Any]) -> None:
        self.rec, self.kind, self.stream, self.args = rec, kind, stream, args

    def __enter__(self) -> None:
        self.start = _clock()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        args = {k: (_nbytes(v) if isinstance(v, torch.Tensor) else v) for k, v in self.args.items()}
        if e is not None:
            args["error"] = type(e).__name__
        self.rec.add(self.start, _clock(), self.stream, "region" if self.stream == "comm" else "train",
                     self.kind, args)


class Recorder:
    """One rank's events: tuples (start ns, end ns, stream, category, name, args), in the order they end."""

    def __init__(self, path: str, rank: int, size: int, limit: int) -> None:
        self.path, self.rank, self.size, self.limit = path, rank, size, limit
        self.events: list[tuple[int, int, str, str, str, Any]] = []  # args: a dict, or a call's tuple
        self.dropped = 0
        self.ids = itertools.count()  # async launches, paired with their waits
        self.align_ns = 0  # this rank's clock at the start barrier's exit (trace_files.align)
        self.boot = trace_files.boot_id()
        self.pid = os.getpid()

    def add(self, start: int, end: int, stream: str, cat: str, name: str, args: Any) -> None:
        if len(self.events) < self.limit:
            self.events.append((start, end, stream, cat, name, args))
        else:
            self.dropped += 1

    def span(self, kind: str, stream: str, args: dict[str, Any]) -> _Span:
        return _Span(self, kind, stream, args)

    def mark(self, kind: str, args: dict[str, Any]) -> None:
        now = _clock()
        self.add(now, now, "marks", "mark", kind, args)

    def flush(self) -> str:
        return trace_files.write_part(self)


# the primitives' arguments by position: (size tensor, op, peer), and the peer's name (comm/primitives.py declares
# them); their events keep a tuple (trace_files.call_args turns it into the arguments when the part is written),
# ~1 us less a call than describe's dict; the rest (gather, scatter, grouped_allreduce, check_exchange) are
# described at once
_FAST = TIMELINE


def _summarizer(name: str, group: str, n: int) -> Callable[[tuple[Any, ...], int], Any]:
    spec = _FAST.get(name)
    if spec is None:
        def slow(args: tuple[Any, ...], ident: int) -> dict[str, Any]:
            out = describe(name, args, group, n)
            if ident >= 0:
                out["id"] = ident
            return out
        return slow
    si, oi, pi, key = spec

    def fast(args: tuple[Any, ...], ident: int) -> tuple[Any, ...]:
        # the dtype and op objects as they are (their names cost ~1 us a call to read): named when written
        t = args[si] if si is not None else None
        return (group, n, t.nbytes if t is not None else 0, t.dtype if t is not None else None,
                args[oi] if oi is not None else None, key, args[pi] if pi is not None else -1, ident)
    return fast


def recorded_call(fn: Callable[..., Any], name: str, rec: Recorder, group: str, n: int) -> Callable[..., Any]:
    """``fn``, the primitive ``name`` of a communicator of ``n`` ranks, recording each call into ``rec``."""
    add, summary = rec.add, _summarizer(name, group, n)
    shown = serves(name)  # a prepared call is the same collective (comm/plans.py)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        start = _clock()
        try:
            return fn(*args)
        finally:
            end = _clock()
            add(start, end, "comm", "call", shown, summary(args, -1))
    return call


class _RecordedWork:
    """An async handle whose ``wait()`` is recorded (its ``id`` is the launch's)."""

    __slots__ = ("_args", "_name", "_rec", "_work")

    def __init__(self, work: Any, rec: Recorder, name: str, args: Any) -> None:
        self._work, self._rec, self._name, self._args = work, rec, name, args

    def wait(self) -> Any:
        start = _clock()
        try:
            return self._work.wait()
        finally:
            self._rec.add(start, _clock(), "comm", "wait", self._name, self._args)

    def test(self) -> bool:
        return bool(self._work.test())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _recorded_async(fn: Callable[..., Any], name: str, rec: Recorder, group: str, n: int) -> Callable[..., Any]:
    base, summary = serves(name), _summarizer(name, group, n)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        start = _clock()
        work = fn(*args)
        end = _clock()
        info = summary(args, next(rec.ids))
        rec.add(start, end, "comm", "launch", base + " launch", info)
        return _RecordedWork(work, rec, base + " wait", info)
    return call


class _RecordingEngine:
    """An engine whose every primitive call is recorded; everything else is the engine's own."""

    def __init__(self, engine: Any, rec: Recorder, group: str) -> None:
        self._inner, self._rec, self._group = engine, rec, group
        for name in (*WATCHED, *EXCHANGES):  # every primitive that moves data (comm/primitives.py)
            setattr(self, name, recorded_call(getattr(engine, name), name, rec, group, engine.size))
        for name in ASYNC:
            setattr(self, name, _recorded_async(getattr(engine, name), name, rec, group, engine.size))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sub(self, lists: Sequence[Sequence[int]]) -> list[Any]:
        made = self._inner.sub(lists)
        return [e if e is None or e.size < 2 else
                _RecordingEngine(e, self._rec, "group " + ",".join(map(str, members)))
                for e, members in zip(made, lists, strict=True)]


def recording(engine: Engine, path: str | None, limit: int) -> Engine:
    """``engine`` recorded into a new timeline when ``path`` is set (``UNIDIST_TIMELINE``), else ``engine``
    itself. The Manager calls this once, before the watchdog wraps the engine; the hooks record from now on."""
    if not path or engine.size < 2:
        return engine
    rec = Recorder(path, engine.rank, engine.size, limit)
    trace_hooks.install(rec)
    return cast("Engine", _RecordingEngine(engine, rec, "world"))


@contextmanager
def watching(what: str, *args: Any) -> Iterator[None]:
    """``regions.watching`` that the timeline also records, as one region on the communication stream: for
    the engine calls unidist's engine wrapper does not see (DeepSpeed's and Horovod's gradient exchanges)."""
    with regions.watching(what, *args), trace_hooks.region(what):
        yield


def align(comm: Any) -> None:
    """At start, every rank together: a barrier whose exit is the instant trace_files aligns the clocks of
    other hosts on. Nothing when the timeline is off."""
    rec = current()
    if rec is not None:
        comm.barrier()
        rec.align_ns = _clock()


def finish(comm: Any) -> str | None:
    """At an orderly shutdown, every rank together: write the trace (rank 0 gets its path) and stop recording."""
    rec = current()
    if rec is None:
        return None
    try:
        return trace_files.collect(comm, rec)
    finally:
        trace_hooks.uninstall()


def abandon() -> None:
    """A shutdown that skips the others (this rank failed): keep this rank's part, stop recording."""
    if current() is not None:
        with processes.quiet():
            trace_hooks.flush()
        trace_hooks.uninstall()


def current() -> Recorder | None:
    """The recorder of this process, when the timeline is on."""
    rec = trace_hooks.recorder()
    return rec if isinstance(rec, Recorder) else None
