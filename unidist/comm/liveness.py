"""The watchdog's liveness channel between hosts: how a rank describes the ranks it cannot see.

The watchdog's heartbeat files (watchdog.py) live on the host that wrote them, so on a job of several hosts a
rank that times out could only say "a peer is stuck" about the ranks elsewhere. So in a job of several hosts
every rank's watchdog thread also serves its heartbeat line on a TCP socket bound to its host's cluster address
(never every interface), the ranks learn where the others serve once at start (one allgather), and a rank whose
watched call times out or fails asks every rank of another host, all at once, with a short deadline
(``PROBE_SECONDS``). What the answer, or its absence, says:

- a line: the rank's watchdog thread runs; the line says what its main thread is doing;
- connection refused: the host answers but nothing listens there: the rank's process is gone;
- no connection before the deadline (or "host unreachable"): the host is down or its link is cut;
- connected but no line: the host's kernel took the connection for a process that does not run: stopped
  (SIGSTOP) or hung holding the GIL.

It costs nothing per collective: the watchdog thread, which wakes every period anyway, waits in ``select`` on
its listening socket instead of on an event. A rank that is probing still serves (its own peers probe it at
the same moment), and so does one that is ending the job.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

__all__ = ["LINK_LOST", "PROBE_SECONDS", "Answer", "Beacon", "Endpoint", "describe", "link_down", "probe"]

LINK_LOST = "has lost its network link"  # how ``describe`` says this host is the one cut off (see its first line)
PROBE_SECONDS = 1.0  # how long a probe waits for a far rank: a healthy host on a cluster network answers in ms
_MAX_LINE = 16384  # a heartbeat line with its position (one count per group the rank is in)


class Endpoint(NamedTuple):
    """Where one rank's watchdog answers probes, and which machine it runs on (its boot id and PID namespace:
    the ranks of this machine are described from their heartbeat files instead)."""

    rank: int
    host: str
    machine: str
    address: str
    port: int


class Answer(NamedTuple):
    """What a probe learned: ``kind`` is ``alive`` (``line`` is the rank's heartbeat), ``refused``,
    ``unreachable`` or ``silent``; ``detail`` the error as the kernel named it."""

    kind: str
    line: str = ""
    detail: str = ""


def job_tag(job: str) -> str:
    """What a rank's answer starts with: the job's token, hashed (a port reused by another job's rank, or any
    other program, does not answer as ours; the token itself, which names the heartbeat directory, stays
    private to the job)."""
    return hashlib.sha256(job.encode()).hexdigest()[:16]


class Beacon:
    """A rank's listening socket, served by its watchdog thread. ``line`` is what a probe gets."""

    def __init__(self, address: str, tag: str) -> None:
        # this host's cluster address only (comm/ sits below unidist.net: the Manager hands the address down)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.bind((address, 0))
            self.sock.listen(64)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.tag = tag
        self.line = "starting"
        self.closed = False

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def answer(self) -> None:
        """Answer every probe waiting in the backlog with this rank's line (a short write to a fresh socket:
        its send buffer is empty, it does not block)."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # BlockingIOError: none left; anything else: the prober gave up
                return
            with conn:
                try:
                    conn.setblocking(False)
                    conn.send(f"{self.tag} {self.line}\n".encode()[:_MAX_LINE])
                except OSError:
                    pass

    def serve(self, seconds: float) -> bool:
        """Answer probes for ``seconds``; True when woken (``wake``: the watchdog is stopping)."""
        end = time.monotonic() + seconds
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.sock, self._wake_r], [], [], left)
            if self._wake_r in ready:
                return True
            if ready:
                self.answer()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        for s in (self.sock, self._wake_r, self._wake_w):
            s.close()


def probe(targets: Sequence[Endpoint], tag: str, seconds: float = PROBE_SECONDS,
          serving: Beacon | None = None) -> dict[int, Answer]:
    """Ask every rank of ``targets`` at once; each answer within ``seconds``. ``serving``: this rank's own
    beacon, answered while waiting (when the caller is the thread that serves it)."""
    out: dict[int, Answer] = {}
    connecting: dict[socket.socket, Endpoint] = {}
    reading: dict[socket.socket, tuple[Endpoint, bytearray]] = {}
    for t in targets:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex((t.address, t.port))
        if err in (0, errno.EINPROGRESS):
            connecting[s] = t
        else:
            out[t.rank] = _failed(err)
            s.close()
    end = time.monotonic() + seconds
    try:
        while connecting or reading:
            left = end - time.monotonic()
            if left <= 0:
                break
            extra = [serving.sock] if serving is not None and not serving.closed else []
            readable, writable, _ = select.select([*reading, *extra], list(connecting), [], left)
            if extra and extra[0] in readable and serving is not None:
                serving.answer()
            for s in writable:
                t = connecting.pop(s)
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    out[t.rank] = _failed(err)
                    s.close()
                else:
                    reading[s] = (t, bytearray())
            for s in readable:
                if s not in reading:
                    continue
                t, buf = reading[s]
                try:
                    data = s.recv(_MAX_LINE)
                except OSError as e:  # reset: the process died while we connected
                    out[t.rank] = _failed(e.errno or errno.ECONNRESET)
                    del reading[s]
                    s.close()
                    continue
                buf += data
                if not data or b"\n" in buf:
                    out[t.rank] = _line(bytes(buf), tag)
                    del reading[s]
                    s.close()
    finally:
        for s, t in connecting.items():
            out[t.rank] = Answer("unreachable", detail=f"no answer in {seconds:g} s")
            s.close()
        for s, (t, _) in reading.items():
            out[t.rank] = Answer("silent", detail=f"connected, no answer in {seconds:g} s")
            s.close()
    return out


def describe(far: Sequence[Endpoint], tag: str, host: str, address: str, serving: Beacon | None = None,
             answers: Mapping[int, Answer] | None = None) -> list[str]:
    """What the ranks of ``far`` answer (``answers``, or a probe now), in the watchdog's words (``rank R <state>
    (why) on host H``), and, when none answers and this host's own link has no carrier, that this host
    (``host``, at ``address``) is the one cut off. A heartbeat line's position (after a tab) is left out."""
    if answers is None:
        answers = probe(far, tag, serving=serving)
    out = []
    for t in far:
        a = answers.get(t.rank, Answer("unreachable"))
        if a.kind == "alive":
            doing = (a.line.partition("\t")[0].split(" ", 3)[3:] or ["?"])[0]
            out.append(f"rank {t.rank} is alive on host {t.host} {doing}")
        elif a.kind == "refused":
            out.append(f"rank {t.rank} has died (its process is gone: {a.detail}) on host {t.host}")
        elif a.kind == "silent":
            out.append(f"rank {t.rank} is not responding (stopped or hung: its host took the probe, its watchdog "
                       f"did not answer: {a.detail}) on host {t.host}")
        else:
            out.append(f"rank {t.rank} is unreachable (host down or link cut: {a.detail}) on host {t.host}")
    if address and out and all(" is unreachable " in p for p in out):
        nic = link_down(address)
        if nic:
            out.insert(0, f"this host, {host}, {LINK_LOST} ({nic} has no carrier)")
    return out


def _failed(err: int) -> Answer:
    name = os.strerror(err).lower()
    if err == errno.ECONNREFUSED:
        return Answer("refused", detail=name)
    if err in (errno.ECONNRESET, errno.EPIPE):
        return Answer("refused", detail=name)
    return Answer("unreachable", detail=name)  # EHOSTUNREACH, ENETUNREACH, ETIMEDOUT, ENETDOWN...


def _line(data: bytes, tag: str) -> Answer:
    text = data.decode(errors="replace").strip()
    mine, _, line = text.partition(" ")
    if mine != tag:  # empty: closed before a word (dying); else not this job's rank (its port was reused)
        return Answer("refused", detail="closed without an answer" if not text else "another program answers")
    return Answer("alive", line=line)


def link_down(address: str, read: Callable[[str], str] | None = None) -> str | None:
    """The name of this host's interface that carries ``address`` when it has no carrier (its cable or switch
    port is down: this host, not its peers, is cut off), else None (up, or unknown off Linux)."""
    try:
        packed = socket.inet_aton(address)
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if got[20:24] == packed:
                try:
                    carrier = (read or _read)(f"/sys/class/net/{name}/carrier").strip()
                except OSError:  # reading carrier of an interface that is administratively down fails
                    return name
                return name if carrier == "0" else None
    return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()
