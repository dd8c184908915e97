"""The per-process watchdog: no wait inside unidist lasts longer than ``UNIDIST_TIMEOUT``, and one that lasts
longer than ``UNIDIST_STALL_WARNING`` is explained.

Engines block inside C with the GIL released (``MPI_Allreduce``, gloo, Horovod's wait, DeepSpeed's bucket
exchange), where no Python timeout can reach them, and a rank that is stopped or spinning elsewhere leaves
its peers there for good. So every place unidist waits on peers is a watched region (regions.py), and a
daemon thread samples what the main thread waits in a few times per timeout. It re-arms Python's GIL-free
``faulthandler`` timer as a backstop for a main thread stuck in C while holding the GIL (it then dumps every
thread's stack and exits 1; this takes over ``faulthandler.dump_traceback_later`` while a Manager runs), and
leaves a heartbeat (time, what it does, and after a tab its position: regions.position) in a file of the job's
directory on this host; on a job of several hosts it also serves that line on the liveness channel
(liveness.py). Each wait a sample finds is located once: the user's file and line that made the call, read off
the waiting thread's stack from this thread (regions.user_line), so every message names the user's own line and
the fast path pays nothing for it.

A wait longer than ``UNIDIST_STALL_WARNING`` (60 s; 0: off) is compared with where every rank it needs is
(stall.py): a desync, seen twice a period apart, prints ``unidist.errors.CollectiveMismatchError`` naming each
rank's call and ends the job at once (the main thread is blocked inside the engine, where no exception can
reach it); a straggler, a blocked rank, a gone rank or a slow engine is a warning, repeated when its kind
changes and every ``UNIDIST_STALL_WARNING`` seconds. The inspector looks sooner when ``UNIDIST_TIMEOUT`` is short
against the warning (at ``LOOK_FRACTION`` of the timeout), so a desync ends the job with its own error, not a
timeout's: a look before the warning ends a desync and keeps quiet about the rest, which the timeout's message
says. A wait longer than ``UNIDIST_TIMEOUT`` prints the call, the user's line, and the inspector's verdict (or,
with the inspector off, what every rank was last seen doing), and ends the job: with the engine's ``abort`` where
it has one (MPI_Abort: mpiexec takes every rank down), then ``os._exit``, so torchrun, the deepspeed launcher and
horovodrun see a failed worker and stop the others. When a watched call raises instead (gloo's "Connection
reset by peer" after a peer was killed), it names the ranks whose process is gone, which the engine's error
does not.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from unidist.comm import liveness, processes, regions, stall, trace_hooks
from unidist.comm.regions import calls, describe_args, explaining, watch, watching

__all__ = ["DESYNC_EXIT_CODE", "LEAVING", "TIMEOUT_EXIT_CODE", "calls", "describe_args", "engine_timeout",
           "explaining", "start", "stop", "watch", "watching"]

TIMEOUT_EXIT_CODE = 124  # what GNU timeout uses: "the command timed out"
DESYNC_EXIT_CODE = 1  # a desync is the program's error, as an exception would be
BACKSTOP_GRACE = 15.0  # seconds past the timeout before the GIL-free backstop ends a process (see _Dog.run):
# 2 s fired once in a healthy rank whose watchdog thread was starved while it imported torch._dynamo under load;
# past ENGINE_GRACE, so an engine's own timeout frees a main thread blocked holding the GIL first, and the error
# names the peers (Horovod's enqueue: engines/horovod/manager.py)
ENGINE_GRACE = 10.0  # seconds the engines wait beyond UNIDIST_TIMEOUT: see engine_timeout
LEAVING = "the barrier ranks meet in when they leave the `with` block"  # a peer still in a collective keeps it there
# the inspector's first look at a wait: UNIDIST_STALL_WARNING, or this fraction of UNIDIST_TIMEOUT when sooner. A
# desync needs heartbeats written a period into the wait and two looks a period apart: with a period of at most an
# eighth of the timeout, it is named by about half the timeout, well before the timeout would end the job
LOOK_FRACTION = 0.25
_clock = time.monotonic


class _Dog:
    def __init__(self, timeout: float, rank: int, size: int, job: str, abort: Callable[[int], None],
                 address: str | None = None, stall_warning: float = 0.0) -> None:
        self.timeout, self.rank, self.size, self.abort = timeout, rank, size, abort
        self.stall = stall_warning
        # several hosts: the liveness channel, bound to this host's cluster address; far: the other hosts' ranks
        self.beacon: liveness.Beacon | None = None
        if address:
            with processes.quiet():  # diagnostics: an address that cannot be bound must not stop training
                self.beacon = liveness.Beacon(address, liveness.job_tag(job))
        self.far: list[liveness.Endpoint] = []
        self.period = min(1.0, timeout / 8, stall_warning / 2 if stall_warning else 1.0)
        self.look = min(stall_warning, timeout * LOOK_FRACTION)  # the inspector's first look (0: off)
        self.dir = os.path.join(_HEARTBEATS, f"unidist-{job}")
        try:
            self.me = processes.identity(os.getpid())
        except OSError:  # no /proc: heartbeats still say what each rank does; nobody gets killed
            self.me = f"{os.getpid()}:?@?"
        self.host = socket.gethostname().split(".")[0] or "?"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="unidist-watchdog", daemon=True)
        # the wait being timed: its token (regions.py) and when a sample first found it
        self.token, self.found, self.found_wall = 0, 0.0, 0.0
        self.said, self.said_at, self.desync = "", 0.0, False  # the inspector's last warning, and a desync seen
        self.at: tuple[int, str] = (0, "")  # a wait's token and the user's line that made it (regions.user_line)

    def run(self) -> None:
        with processes.quiet():
            os.makedirs(self.dir, mode=0o700, exist_ok=True)  # the name is random per job
        st = regions.waiting()
        while True:
            # the backstop: if this thread cannot run (the main thread holds the GIL inside a blocked C call,
            # as Horovod's enqueue does while its background thread waits for a stopped peer), Python's C-level
            # faulthandler timer, re-armed here, dumps every thread's stack and exits 1
            faulthandler.dump_traceback_later(self.timeout + BACKSTOP_GRACE, exit=True)
            cur = st.cur
            token, what, args = (cur[0], cur[1], cur[2]) if cur is not None else (0, "", ())
            now = _clock()
            if token != self.token:  # a new wait, or none: timed from now, to within one period
                self.token, self.found, self.said, self.desync = token, now, "", False
                self.found_wall = time.time()
            if token and token != self.at[0]:
                self.locate(token)
            self.beat(f"waiting in {what}{describe_args(args)}{self.where(token)}" if token else "computing")
            waited = now - self.found
            if token and waited > self.timeout and st.token == token:
                self.fire(what, args, waited, token)
                return
            if token and self.stall and waited > self.look and st.token == token and self.inspect(waited):
                return
            if self.beacon is not None:
                if self.beacon.serve(self.period) or self.stopped.is_set():
                    return
            elif self.stopped.wait(self.period):
                return

    def locate(self, token: int) -> None:
        """Where the user's program made the wait ``token`` (its file and line), read off the waiting thread's
        stack once per wait a sample finds: kept only if that very wait is still on when the read is done."""
        at = regions.user_line(regions.waiter())
        if regions.waiting().token == token:
            self.at = (token, at)

    def where(self, token: int) -> str:
        """`` at train.py:42`` for the wait ``token`` when it was located, else empty."""
        return f" at {self.at[1]}" if token and self.at[0] == token and self.at[1] else ""

    def beat(self, doing: str) -> None:
        """This rank's heartbeat: wall time, what it is doing and its position, replaced atomically."""
        path = os.path.join(self.dir, str(self.rank))
        line = f"{time.time():.3f} {self.me} {self.host} {doing}"
        if self.stall:
            line += "\t" + json.dumps(regions.position(self.at), separators=(",", ":"))
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

    def survey(self, since: float = 0.0) -> tuple[list[stall.Seen], list[str], list[str]]:
        """Every other rank as seen now: from its heartbeat file on this host, over the liveness channel on
        other hosts. Also the watchdog's line about each, and the identities of local ranks not responding.

        ``since`` (wall time): a position written before it is not used (None). A rank stopped just after it
        left a call still shows that call until its heartbeat goes stale, and would look like a rank that
        never left it: only a heartbeat written after this rank's wait began says where a rank is during it."""
        seen, out, stuck, now = [], [], [], time.time()
        for r in range(self.size):
            if r == self.rank:
                continue
            try:
                with open(os.path.join(self.dir, str(r))) as f:
                    text, _, where = f.read().partition("\t")
                stamp, pid, host, doing = text.split(" ", 3)
                age = now - float(stamp)
            except (OSError, ValueError):
                continue  # on another host, or never started its watchdog
            if not processes.alive(pid):
                line = (f"rank {r} has died (its process ended without leaving unidist) on host {host}: its last "
                        f"heartbeat, {age:.1f} s ago (one every {self.period:g} s while it lived), had it {doing}"
                        f"{self.progress(_position(where))}")
                seen.append(stall.Seen(r, host, "dead", why=line))
            elif age > 3 * self.period + 1:
                line = (f"rank {r} is not responding (stopped, hung in C or dead) on host {host}: last heartbeat "
                        f"{age:.1f} s ago, {doing}")
                seen.append(stall.Seen(r, host, "stopped", why=line))
                stuck.append(pid)
            else:
                line = f"rank {r} is alive, {doing}"
                seen.append(stall.Seen(r, host, position=_position(where) if float(stamp) >= since else None))
            out.append(line)
        if self.far:
            far_seen, far_lines = self.far_survey(since)
            seen += far_seen
            out += far_lines
        return seen, out, stuck

    def progress(self, position: dict[str, Any] | None) -> str:
        """``, having made 3 collectives of all ranks; this rank has made 14``: how far a dead rank's last heartbeat
        is behind this rank (it died within a period of that heartbeat, after as many calls as it made since)."""
        if position is None:
            return ""
        key = regions.WORLD
        theirs, mine = int(position.get("seqs", {}).get(key, 0)), int(regions.position()["seqs"].get(key, 0))
        return f", having made {stall.made(key, theirs)}; this rank has made {mine}"

    def far_survey(self, since: float = 0.0) -> tuple[list[stall.Seen], list[str]]:
        """What the ranks of other hosts answer over the liveness channel (see liveness.py), and whether this
        host is the one cut off. The watchdog thread keeps answering its own peers while it asks."""
        own = threading.current_thread() is self.thread
        tag = self.beacon.tag if self.beacon else ""
        answers = liveness.probe(self.far, tag, serving=self.beacon if own else None)
        lines = liveness.describe(self.far, tag, self.host, self.beacon.sock.getsockname()[0] if self.beacon else "",
                                  answers=answers)
        states = {"alive": "alive", "refused": "dead", "silent": "stopped", "unreachable": "unreachable"}
        seen = []
        for t in self.far:
            a = answers.get(t.rank, liveness.Answer("unreachable"))
            why = next((x for x in lines if x.startswith(f"rank {t.rank} ")), "")
            text, _, where = a.line.partition("\t")
            fresh = _stamp(text) >= since  # as for this host's heartbeats (see survey)
            seen.append(stall.Seen(t.rank, t.host, states[a.kind], _position(where) if fresh else None, why))
        return seen, lines

    def peers(self) -> tuple[list[str], list[str]]:
        """What each other rank was last seen doing, and the identities of local ranks not responding."""
        _, out, stuck = self.survey()
        return out, stuck

    def far_peers(self) -> list[str]:
        """The far ranks' part of :meth:`peers`."""
        return self.far_survey()[1] if self.far else []

    def verdict(self) -> tuple[stall.Verdict, list[str], list[str]]:
        """Why this rank's wait is not over (stall.py), and the survey's lines and stuck identities."""
        # positions written a period after a sample first found this wait (wall time: heartbeats carry it); a
        # live rank beats every period, and one written just around the wait's start may predate it
        seen, lines, stuck = self.survey(since=self.found_wall + self.period)
        return stall.classify(self.rank, self.size, regions.position(self.at), seen), lines, stuck

    def inspect(self, waited: float) -> bool:
        """A wait past the inspector's look (UNIDIST_STALL_WARNING, or sooner on a short UNIDIST_TIMEOUT): end a
        desync, and past UNIDIST_STALL_WARNING say why it waits (stall.py). True when a desync ended the job."""
        verdict = self.verdict()[0]
        if verdict.kind == "unknown":  # nothing seen since the wait began (a stopped rank not yet stale)
            return False
        if verdict.kind == "desync":
            if self.desync:  # the second sample in a row: not a torn read of a rank between two calls
                self.end_desync(verdict)
                return True
            self.desync = True
            return False
        self.desync = False
        now = _clock()
        if waited <= self.stall:  # an early look, for a desync: the rest is the timeout's message to say
            return False
        if verdict.kind != self.said or now - self.said_at >= self.stall:
            self.said, self.said_at = verdict.kind, now
            trace_hooks.mark("stall", kind=verdict.kind, waited=round(waited, 3), verdict=verdict.text())
            print(f"unidist: rank {self.rank} of {self.size}: stalled for {waited:.0f} s "
                  f"(UNIDIST_STALL_WARNING={self.stall:g}): {stall.headline(verdict.kind)}. {verdict.text()}. "
                  f"UNIDIST_TIMEOUT={self.timeout:g} ends the job if the wait goes on.", file=sys.stderr, flush=True)
        return False

    def end_desync(self, verdict: stall.Verdict) -> None:
        """Ranks in different calls can never finish the job: say which call each is in and end it now."""
        print(f"unidist: rank {self.rank} of {self.size}: unidist.errors.CollectiveMismatchError: "
              f"{stall.headline('desync')}: {verdict.text()}. Ending the job; run with UNIDIST_CHECK_COLLECTIVES=1 "
              "to stop at the first call that differs, with a traceback.", file=sys.stderr, flush=True)
        with processes.quiet():  # the timeline (UNIDIST_TIMELINE) keeps this rank's part
            trace_hooks.mark("stall", kind="desync", verdict=verdict.text())
            trace_hooks.flush()
        if self.beacon is not None:
            self.beacon.line = f"{time.time():.3f} {self.me} {self.host} ending the job: ranks are in different calls"
        pause = self.beacon.serve if self.beacon is not None else time.sleep
        processes.end_job(self.abort, DESYNC_EXIT_CODE, pause)

    def fire(self, what: str, args: tuple[Any, ...], waited: float, token: int) -> None:
        """A wait past UNIDIST_TIMEOUT: say which call, where the user made it and why it waits (the inspector's
        verdict, taken now; with the inspector off or nothing seen, what every rank was last seen doing), and end
        the job."""
        verdict, peers, stuck = self.verdict() if self.stall else (stall.Verdict("unknown"), *self.peers())
        if verdict.kind == "unknown":
            seen = ("; ".join(peers) + ".") if peers else "no other rank's heartbeat is visible on this host."
            why = f"{seen} Another rank is stuck, dead, exited or made a different call"
        else:  # the verdict names the ranks the call needs; a line saying this host lost its link goes first
            lost = "".join(f"{p}; " for p in peers if liveness.LINK_LOST in p)
            why = f"{lost}{stall.headline(verdict.kind)}: {verdict.text()}"
        print(f"unidist: rank {self.rank} of {self.size}: {what}{describe_args(args)}{self.where(token)} has waited "
              f"{waited:.1f} s, longer than UNIDIST_TIMEOUT={self.timeout:g}: {why}. Ending the job; raise "
              "UNIDIST_TIMEOUT if the wait is legitimate.", file=sys.stderr, flush=True)
        for pid in stuck:
            processes.kill(pid)
        with processes.quiet():  # the timeline (UNIDIST_TIMELINE) keeps this rank's part: it shows the wait
            trace_hooks.mark("timeout", call=regions.calls(), what=what, waited=round(waited, 3))
            trace_hooks.flush()
        if self.beacon is not None:  # peers probing now learn this rank is alive and why it ends the job
            self.beacon.line = f"{time.time():.3f} {self.me} {self.host} ending the job: {what} timed out"
        pause = self.beacon.serve if self.beacon is not None else time.sleep  # peers probing still get an answer
        processes.end_job(self.abort, TIMEOUT_EXIT_CODE, pause,
                          cut_off=any(liveness.LINK_LOST in p for p in peers))

    def failed(self, calls: int, what: str, args: tuple[Any, ...], exc: BaseException) -> None:
        """A watched call raised (``calls``: the watched calls so far, regions.calls). When a peer was killed, the
        engine's error names no rank (gloo: "Connection reset by peer", MPI: a lost connection), so say which rank
        died or stopped responding, and the user's line that made the call. The peer's process may still be
        exiting when its closed socket reaches us: look a few times."""
        line = regions.user_line(sys._getframe())  # called on the thread whose call failed
        at = f" at {line}" if line else ""
        for attempt in range(FAILED_LOOKS):
            peers = [p for p in self.peers()[0] if not _ALIVE.match(p)]
            if peers:
                print(f"unidist: rank {self.rank} of {self.size}: {what}{describe_args(args)}{at} failed "
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


_ALIVE = re.compile(r"rank \d+ is alive\b")  # survey's line for a live rank, local or far


def _stamp(line: str) -> float:
    """A heartbeat line's wall time (0.0 when it has none)."""
    try:
        return float(line.split(" ", 1)[0])
    except ValueError:
        return 0.0


def _position(text: str) -> dict[str, Any] | None:
    """A heartbeat's position (regions.position, as JSON), or None when it has none or is cut short."""
    try:
        got = json.loads(text) if text else None
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


_HEARTBEATS = tempfile.gettempdir()


_dog: _Dog | None = None


def engine_timeout(timeout: float) -> datetime.timedelta:
    """The timeout handed to an engine (gloo, torch's store): a little longer than the watchdog's, so the
    watchdog, which names the call and the ranks, fires first; the engine's own error is the fallback."""
    return datetime.timedelta(seconds=timeout + ENGINE_GRACE)


def start(timeout: float, rank: int, size: int, job: str, abort: Callable[[int], None], *,
          address: str | None = None, exchange: Callable[[Any], list[Any]] | None = None,
          stall_warning: float = 0.0) -> None:
    """Start this process's watchdog (one per process; a second start replaces the first). ``job`` is the
    same string on every rank of the job and differs between jobs: it names the heartbeat directory;
    ``abort`` is the engine's (``Engine.abort``), called before this process exits on a timeout.

    A job of several hosts also passes ``address``, this host's cluster address, where the watchdog answers
    probes from the other hosts, and ``exchange``, an allgather of one object per rank (every rank calls
    ``start`` together then), by which the ranks learn where the others answer. ``stall_warning``:
    UNIDIST_STALL_WARNING, the seconds of a wait before the inspector explains it (0: off)."""
    global _dog
    stop()
    regions.reset(size)
    _dog = _Dog(timeout, rank, size, job, abort, address, stall_warning)
    regions.failure_hook = _dog.failed
    _dog.thread.start()
    if exchange is not None:
        table = exchange(_dog.endpoint())  # a watched call: a rank that never arrives is caught as any other
        here = processes.machine()
        _dog.far = [liveness.Endpoint(*e) for e in table if e is not None and e[2] != here]
        regions.reset(size)  # every rank made the exchange: count from here, as a job of one host does


def stop() -> None:
    """Stop the watchdog and remove this rank's heartbeat (at shutdown)."""
    global _dog
    if _dog is not None:
        regions.failure_hook = None
        _dog.leave()
        _dog = None


# times, 0.1 s apart, a failed watched call looks for a dead peer (see _Dog.failed): only errors pay for it
FAILED_LOOKS = 5
