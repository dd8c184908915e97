"""The processes of a job on this machine: naming one for good, telling whether it still runs, and ending the
job. The watchdog's heartbeats name processes this way; ``end_job`` is how a rank that gives up takes every
other one down (the engine's abort, hydra's, then exit).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ABORT_GRACE", "alive", "end_job", "identity", "kill", "machine", "quiet"]


# What a rank printed just before it ends the job sits in a pipe to its launcher; MPICH's hydra drops what it
# has not yet forwarded when MPI_Abort arrives, so under load the line naming the culprit was lost (CI, stop
# 28: 2 of 8 runs on a loaded 2-core machine). A pause this long before the abort let every run keep it.
ABORT_GRACE = 1.0


@functools.cache
def machine() -> str:
    """Which process table this process sees: its boot id and PID namespace. Heartbeats can sit in a directory
    several hosts share (mpiexec hands the launching host's TMPDIR to every rank; a TMPDIR on NFS), and a pid
    means something only in the table it came from."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return "?"


def identity(pid: int | str) -> str:
    """``pid:start-time@machine``: names one process for good (a pid alone can be reused once it exits, and
    means another process on another host)."""
    with open(f"/proc/{pid}/stat") as f:
        return f"{pid}:{f.read().rpartition(')')[2].split()[19]}@{machine()}"


def alive(who: str) -> bool:
    """Whether the process ``who`` (an ``identity``) still runs (neither gone nor a zombie awaiting its
    launcher). A process of another host, or any without /proc, counts as alive: only its heartbeat's age tells."""
    pid, _, rest = who.partition(":")
    if rest.partition("@")[2] != machine():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return f"{pid}:{fields[19]}@{machine()}" == who and fields[0] not in "ZX"


def kill(who: str) -> None:
    """SIGKILL a rank of this job that stopped responding: a stopped process ignores the SIGTERM that
    torchrun, horovodrun and the deepspeed launcher send first (torchrun then waits 30 s before SIGKILL).
    Only the very process that wrote the heartbeat is touched (pid, start time and machine must all match)."""
    with quiet():
        pid = who.partition(":")[0]
        if identity(pid) == who:
            os.kill(int(pid), signal.SIGKILL)


@contextmanager
def quiet() -> Iterator[None]:
    """Diagnostics (heartbeats, a sibling's /proc entry, hydra's socket): an error there must not stop training."""
    try:
        yield
    except OSError:
        pass




def end_job(abort: Callable[[int], None], code: int, pause: Callable[[float], Any] = time.sleep) -> None:
    """End every rank: the engine's abort where it has one (MPI_Abort), else exit and let the launcher stop
    the rest. Flushes this rank's output and waits ``ABORT_GRACE`` first (``pause``: the watchdog answers
    probes meanwhile), so the launcher forwards it."""
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        pause(ABORT_GRACE)
        abort(code)
        launcher_abort(code)
    finally:
        os._exit(code)


def launcher_abort(code: int) -> None:
    """Ask MPICH's mpiexec (hydra) to end the job, as MPI_Abort does, when the engine is not MPI's (torch,
    Horovod under mpiexec): a rank that merely exits leaves mpiexec waiting for every other host's proxy, and
    the proxy of a host whose link is cut never answers (measured: the job outlived a 120 s limit). Hydra hands
    each rank the PMI-1 wire as the descriptor ``PMI_FD``; its ``abort`` command needs no ``init`` first."""
    fd = os.environ.get("PMI_FD", "")  # the launcher's channel, not a setting: config.py has no business here
    if fd.isdigit():
        with quiet():
            os.write(int(fd), f"cmd=abort exitcode={int(code)}\n".encode())
            time.sleep(ABORT_GRACE)  # hydra kills this process meanwhile
