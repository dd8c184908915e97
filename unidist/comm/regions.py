"""Watched regions: what the main thread is waiting in, kept where the watchdog thread can read it.

Every place unidist waits on peers is a *watched region*: the primitives of every engine of 2+ ranks
(:func:`watch` wraps the world's engine once, and its sub-engines are wrapped as it makes them), the waits of
async handles, and the engine calls that exchange gradients inside DeepSpeed and Horovod (:func:`watching`).
The watchdog (watchdog.py) samples this state a few times a second; it ends a wait longer than
``UNIDIST_TIMEOUT`` and, past ``UNIDIST_STALL_WARNING``, compares where every rank is (stall.py).

For that comparison each engine (the world, each group) numbers the collectives entered on it: every member
makes the same calls on it in the same order, so two ranks at the same number on the same engine are at the
same place, and a rank whose number is lower is behind. Groups are numbered apart, so a rank outside a group
does not shift the world's count. Point-to-point calls are not numbered (their order is per pair): they name
their peer.

The fast path is always on, so it stays small: entering a region increments two counters and stores the call as
one tuple (no clock read: the watchdog times a wait from the first sample that finds it, to within one period;
one store, so the watchdog thread never reads half of one call and half of another). Where the user's program made
the call (its file and line) is not recorded there: the watchdog reads it off the waiting thread's stack when it
reports a wait (:func:`waiter`, :func:`user_line`), which costs the fast path nothing.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import sysconfig
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, cast

import torch

from unidist.comm import mismatch
from unidist.comm.engine import Engine
from unidist.comm.primitives import ASYNC, POINT_TO_POINT, WATCHED, declared
from unidist.errors import UnidistError

__all__ = ["Seq", "Waiting", "calls", "describe_args", "explaining", "failure_hook", "position", "user_line", "waiter",
           "waiting", "watch", "watching"]

# engine regions (DeepSpeed's and Horovod's own exchanges, an engine's start) are numbered on one sequence
# of all ranks: every rank enters them in the same order, as it does the world's collectives
REGIONS = "regions"
WORLD = "world"  # the world engine's sequence
CHECK = "the check that all ranks call "  # what the desync check's exchange is called, before the call it checks


class Seq:
    """The collectives entered on one engine. ``key`` names the engine the same way on every member: ``world``,
    or ``group 0,2#1`` (its members' world ranks, and how many groups of those very members were made before)."""

    __slots__ = ("__weakref__", "key", "members", "n")

    def __init__(self, key: str, members: Sequence[int]) -> None:
        self.key, self.members, self.n = key, tuple(members), 0


# every live sequence, for the heartbeat (a group's engine that is freed drops out)
_seqs: weakref.WeakSet[Seq] = weakref.WeakSet()


Call = tuple[int, str, tuple[Any, ...], "Seq | None", int]  # (token, what, args, engine, its number there)


class Waiting:
    """What the main thread is waiting in; written by the main thread, read by the watchdog thread.

    ``cur`` is the outermost watched region's call, or None while computing: (token: the call number it began at,
    what, args, the engine's Seq, its number there; 0 for a point-to-point call, which is not numbered). Tokens
    are never reused in a process (``calls`` is not reset; ``base`` is where the current job's count starts), so
    the watchdog never takes a wait for an earlier one."""

    __slots__ = ("base", "calls", "cur")

    def __init__(self) -> None:
        self.calls = 0  # watched calls so far, on any engine, in this process
        self.base = 0  # ``calls`` when this job's count began (reset)
        self.cur: Call | None = None

    @property
    def token(self) -> int:
        """The call number the current wait began at; 0 when none (not waiting): unique in the process."""
        cur = self.cur
        return 0 if cur is None else cur[0]


_state = Waiting()
_regions = Seq(REGIONS, ())  # members: every rank (filled in by reset)
# set by the watchdog: called when an engine error leaves the outermost region (names the peers that died)
failure_hook: Callable[[int, str, tuple[Any, ...], BaseException], None] | None = None


def reset(size: int) -> None:
    """A new job (the watchdog's start): nothing entered yet, the world and the regions numbered from 0."""
    st = _state
    st.cur, st.base = None, st.calls
    _regions.members, _regions.n = tuple(range(size)), 0
    _seqs.add(_regions)
    for seq in list(_seqs):
        seq.n = 0


def waiting() -> Waiting:
    """The one ``Waiting`` the main thread writes, for the watchdog thread's sampling loop to read (its ``cur``,
    ``calls`` and ``token``); nothing but this module writes it."""
    return _state


def calls() -> int:
    """Watched engine calls this process has made so far (every collective and point-to-point primitive of
    unidist's engines, and the engine regions DeepSpeed and Horovod exchange gradients in): a test or a
    benchmark reads the difference to count communication. Counted from the watchdog's start."""
    return _state.calls - _state.base


def position(where: tuple[int, str] = (0, "")) -> dict[str, Any]:
    """Where this rank is, for its heartbeat: the collectives entered on each engine, and the call it waits in
    (engine key, number, kind, arguments as text; ``peer`` for point-to-point; ``at``: the user's line that made
    it, when ``where`` is (that wait's token, :func:`user_line`)) or None while computing. Read by the watchdog
    thread while the main thread runs: a torn read is possible and is why a desync must be seen twice before it
    ends the job (stall.py)."""
    cur = _state.cur
    token, what, args, seq, n = cur if cur is not None else (0, "", (), None, 0)
    counts = {s.key: s.n for s in list(_seqs) if s.n}
    call: dict[str, Any] | None = None
    if token:
        call = {"kind": what, "args": describe_args(args), "sig": signature(what, args)}
        if where[0] == token and where[1]:
            call["at"] = where[1]
        if seq is not None and n:
            call["on"], call["n"] = seq.key, n
        elif seq is not None and len(args) >= 2 and isinstance(args[1], int) and 0 <= args[1] < len(seq.members):
            call["peer"] = seq.members[args[1]]  # the peer's world rank
    return {"seqs": counts, "call": call}


def signature(what: str, args: tuple[Any, ...]) -> str:
    """What must agree between ranks in the same collective: its kind, the dtype, the op and root, and the size
    where every rank passes the same one."""
    kind = what.removeprefix("group ").removesuffix(" wait")
    parts = [kind]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if i == 0:
                parts.append(str(a.dtype).replace("torch.", ""))
                if kind in ("allreduce", "broadcast"):
                    parts.append(str(a.numel()))
        elif isinstance(a, enum.Enum):
            parts.append(f"op={a.value}")
        elif isinstance(a, int) and kind == "broadcast":
            parts.append(f"root={a}")
    return " ".join(parts)


@contextmanager
def watching(what: str, *args: Any) -> Iterator[None]:
    """A watched region around an engine call that waits on peers (a gradient exchange, an engine's start),
    numbered on the engine regions' sequence."""
    _regions.n += 1
    with _region(what, args, _regions, _regions.n):
        yield


@contextmanager
def _region(what: str, args: tuple[Any, ...], seq: Seq | None, n: int) -> Iterator[None]:
    st = _state
    st.calls += 1
    outer = st.cur is None
    if outer:
        st.cur = (st.calls, what, args, seq, n)
    try:
        yield
    except Exception as exc:
        if outer:
            _explain(exc)
        raise
    finally:
        if outer:
            st.cur = None


@contextmanager
def explaining(what: str) -> Iterator[None]:
    """An engine call that should not wait on peers but can (Horovod's enqueue in a backward hook, see
    engines/horovod/manager.py): not timed, as computing happens inside it, but an engine error leaving it names the
    peers that died or stopped, as one leaving a watched region does."""
    try:
        yield
    except Exception as exc:
        if _state.cur is None and failure_hook is not None and not isinstance(exc, UnidistError):
            failure_hook(calls(), what, (), exc)
        raise


def _explain(exc: Exception) -> None:
    """An engine error left the outermost watched region: name the peers that died, unless unidist raised it
    on purpose (a typed error: bad input, a detected mismatch), which says what it needs to."""
    _, what, args, _, _ = _state.cur or (0, "", (), None, 0)
    if failure_hook is not None and not isinstance(exc, UnidistError):
        failure_hook(calls(), what, args, exc)
    mismatch.retype(exc, what, args, describe_args)  # an engine's words for a mismatch: typed


def _watched(fn: Callable[..., Any], what: str, seq: Seq, numbered: bool = True) -> Callable[..., Any]:
    st = _state
    step = 1 if numbered else 0  # point-to-point (not numbered): its order is per pair; its n is 0

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        st.calls += 1
        seq.n += step
        if st.cur is not None:
            return fn(*args)
        st.cur = (st.calls, what, args, seq, seq.n * step)
        try:
            return fn(*args)
        except Exception as exc:
            _explain(exc)
            raise
        finally:
            st.cur = None
    return call


def _watched_check(fn: Callable[..., Any], where: str, seq: Seq) -> Callable[..., Any]:
    """The desync check (check.py), watched and named by the call it checks: ``the check that all ranks call
    allreduce(float32[4], ...)`` (a kind of its own: a rank in it and a rank in that very call are not at the same
    place); ``fn(call, *args)`` is the engine's ``check_exchange``."""
    named: dict[str, Callable[..., Any]] = {}

    def call(name: str = "call", *args: Any) -> Any:
        watched = named.get(name)
        if watched is None:
            watched = named[name] = _watched(functools.partial(fn, name), f"{CHECK}{where}{name}", seq)
        return watched(*args)
    return call


class _WatchedWork:
    __slots__ = ("_args", "_n", "_seq", "_what", "_work")

    def __init__(self, work: Any, what: str, args: tuple[Any, ...], seq: Seq, n: int) -> None:
        self._work, self._what, self._args, self._seq, self._n = work, what, args, seq, n

    def wait(self) -> None:
        with _region(self._what, self._args, self._seq, self._n):  # the wait is the call it started
            self._work.wait()

    def test(self) -> bool:
        return bool(self._work.test())


def _watched_async(fn: Callable[..., Any], what: str, seq: Seq) -> Callable[..., Any]:
    # the start is watched too: an engine without a native async call runs the blocking primitive right here
    # (Engine's derived defaults), so a peer that never arrives must be caught in the start as in the wait
    start, waiting = _watched(fn, what, seq), what + " wait"

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        work = start(*args)
        return _WatchedWork(work, waiting, args, seq, seq.n)
    return call


class _WatchedEngine:
    """An engine whose every wait on peers is a watched region; everything else is the engine's own. Its
    sub-engines (groups) are watched alike, their calls named ``group <call>`` and numbered apart."""

    def __init__(self, engine: Any, where: str, seq: Seq) -> None:
        self._inner, self._where, self._seq = engine, where, seq
        self._made: dict[tuple[int, ...], int] = {}  # groups of these members made so far (their keys' #k)
        _seqs.add(seq)
        # every primitive that moves data (comm/primitives.py), as instance attributes: a call costs what the engine's
        # own method does, plus ~0.1 us; each named by the collective it serves (allreduce_prepared is allreduce for
        # the heartbeat and the stall inspector)
        for name in WATCHED:
            setattr(self, name, _watched(getattr(engine, name), where + declared(name).serves, seq,
                                         name not in POINT_TO_POINT))
        for name in ASYNC:
            setattr(self, name, _watched_async(getattr(engine, name), where + declared(name).serves, seq))
        self.check_exchange = _watched_check(engine.check_exchange, where, seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sub(self, lists: Any) -> list[Any]:
        out = []
        for members, e in zip(lists, self._inner.sub(lists), strict=True):
            world = tuple(self._seq.members[r] for r in members)
            k = self._made[world] = self._made.get(world, -1) + 1  # counted where this rank is no member too
            if e is None or e.size < 2:
                out.append(e)
            else:
                key = f"group {','.join(map(str, world))}#{k}"
                out.append(_WatchedEngine(e, "group ", Seq(key, world)))
        return out


def watch(engine: Engine) -> Engine:
    """``engine`` (of 2+ ranks) with every primitive a watched region, and its sub-engines too: wrapped once,
    when the Manager makes it."""
    return cast("Engine", _WatchedEngine(engine, "", Seq(WORLD, range(engine.size))))


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
        elif isinstance(a, (list, tuple)) and a and all(isinstance(x, torch.Tensor) for x in a):  # grouped calls
            parts.append(f"[{describe_args(tuple(a[:4]))[1:-1]}{f', ... ({len(a)} tensors)' if len(a) > 4 else ''}]")
        elif isinstance(a, (list, tuple)) and len(a) <= 8 and all(isinstance(x, (int, float, str)) for x in a):
            parts.append(repr(list(a)))
        elif not isinstance(a, (list, tuple)):
            parts.append(type(a).__name__)
        # else: an engine's prepared arguments (a buffer, its count and MPI datatype), not the user's: left out
    return f"({', '.join(parts)})" if parts else ""


# -------------------------------------------------------------- where the user's program made the waiting call
# Read only when the watchdog reports a wait (once per wait it finds, from its own thread) or a watched call fails:
# nothing here runs on the fast path.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # unidist/
# the interpreter's own modules and installed packages (torch's autograd between a backward and its hooks, runpy):
# skipped on the way out to the user's line
_LIBRARIES = tuple(sorted({os.path.join(p, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(k))}))
_WATCHED_CODES = frozenset({_watched(print, "", Seq("", ())).__code__, _WatchedWork.wait.__code__})


def waiter() -> FrameType | None:
    """The innermost frame of the thread inside a watched call (found by the wrapper's frame on its stack), or of
    the main thread when none is (an engine region entered with :func:`watching`); None when it has none. Read
    from another thread (the watchdog's) while that thread may move on: the caller checks that the wait it read
    this for is still on afterwards (watchdog._Dog.locate)."""
    try:
        frames = sys._current_frames()
    except Exception:  # only serves a message
        return None
    me = threading.get_ident()
    for ident, top in frames.items():
        f: FrameType | None = top
        while ident != me and f is not None:
            if f.f_code in _WATCHED_CODES:
                return top
            f = f.f_back
    main = threading.main_thread().ident
    return frames.get(main) if main is not None else None


def user_line(frame: FrameType | None) -> str:
    """Where the user's program called into unidist, as ``path:line`` (the path relative to the working directory
    when under it), for a stack whose innermost frame is ``frame``: going outwards from the innermost unidist frame,
    the first frame of neither unidist, the standard library nor an installed package; failing that, the first
    frame outside unidist (a library that calls unidist). Empty when no unidist frame is on the stack, or when
    the stack cannot be read (this only serves a message: it never raises)."""
    try:
        return _user_line(frame)
    except Exception:
        return ""


def _user_line(frame: FrameType | None) -> str:
    f = frame
    while f is not None and not f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    fallback: FrameType | None = None
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_PACKAGE):
            if not name.startswith(_LIBRARIES) and not name.startswith("<frozen "):
                return _line(f)
            fallback = fallback or f
        f = f.f_back
    return _line(fallback) if fallback is not None else ""


def _line(f: FrameType) -> str:
    name = f.f_code.co_filename
    try:
        rel = os.path.relpath(name)
        if not rel.startswith(os.pardir + os.sep):
            name = rel
    except (ValueError, OSError):  # another drive (Windows), or the working directory is gone
        pass
    return f"{name}:{f.f_lineno}"
