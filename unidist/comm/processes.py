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

__all__ = ["ABORT_GRACE", "AGENT_GRACE", "alive", "end_job", "identity", "kill", "machine", "quiet", "stop_agent"]


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
    """SIGKILL a rank of this job that stopped responding (or a stuck torchrun agent, see ``stop_agent``): a
    stopped process ignores the SIGTERM that torchrun, horovodrun and the deepspeed launcher send first
    (torchrun then waits 30 s before SIGKILL). Only the very process named is touched (pid, start time and
    machine must all match)."""
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




def end_job(abort: Callable[[int], None], code: int, pause: Callable[[float], Any] = time.sleep, *,
            cut_off: bool = False) -> None:
    """End every rank: the engine's abort where it has one (MPI_Abort), else exit and let the launcher stop
    the rest. Flushes this rank's output and waits ``ABORT_GRACE`` first (``pause``: the watchdog answers
    probes meanwhile), so the launcher forwards it. ``cut_off``: this host has lost its network link, so its
    torchrun agent is told to stop too (``stop_agent``)."""
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        pause(ABORT_GRACE)
        abort(code)
        launcher_abort(code)
        if cut_off:
            stop_agent()
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


# how torchrun's agent shows in its command line (torchrun, python -m torch.distributed.run / .launch)
_AGENTS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
# seconds a torchrun agent has to act on SIGTERM before it is taken for stuck in its store read (an agent that
# can act does so at once: its handler runs in the main thread as soon as it is back in Python)
AGENT_GRACE = 2.0


def stop_agent(grace: float = AGENT_GRACE) -> None:
    """End this rank's torchrun agent (its parent) on a host that has lost its network link.

    Normally a rank that exits is all torchrun needs: its agent looks at its workers every monitor interval.
    Between two looks it reads the rendezvous state from the c10d store (``num_nodes_waiting``, torch 2.13's
    torch/distributed/elastic/agent/server/api.py:959, through c10d_rendezvous_backend.py:114), and on a host
    cut off from the store's host that read never returns: ``TCPStore::get`` first waits for the key
    (``doWait``); when the rendezvous's ``read_timeout`` has passed it sends a cancel and then blocks in
    ``recv`` for the reply with no timeout at all (``TCPClient::receiveValue`` -> ``tcputil::recvBytes``,
    seen with gdb), which only TCP's retransmission limit ends (``tcp_retries2``: ~15 minutes). So no
    torchrun setting bounds it, and SIGTERM, torchrun's way to stop a node, is not acted on either (``recv``
    is restarted after the signal; the Python handler never runs). The agent is sent SIGTERM first: when its
    main thread is in Python (waiting for the rendezvous lock its keep-alive thread holds while that thread is
    the one in the read), it stops its workers and exits at once, without closing the rendezvous
    (launcher/api.py:391-395). If it has not acted within ``grace`` seconds (it would have sent this rank
    SIGTERM), it is stuck in that ``recv``, and SIGKILL is the only way to end it; its other workers end
    through their own watchdogs, as this one did. Only a host that lost its own link asks this: there the
    agent can neither reach the rendezvous nor restart into it, while an agent elsewhere sees the failed
    worker and restarts or stops as it was told to."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # the launcher's own variable, as PMI_FD above
        return
    with quiet():
        parent = os.getppid()
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        if parent <= 1 or not any(a.endswith(_AGENTS) for a in argv[:3]):
            return
        agent = identity(parent)
        os.kill(parent, signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if not alive(agent):
                return
            time.sleep(0.05)
        print(f"unidist: torchrun's agent (pid {parent}) did not act on SIGTERM in {grace:g} s: it is blocked "
              "reading the rendezvous store of a host it cannot reach; killing it", file=sys.stderr, flush=True)
        kill(agent)
