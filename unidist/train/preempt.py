"""Preemption: the training loop stops on every rank at the same step when the scheduler says the job must end.

Slurm warns a job before its time limit (``sbatch --signal=USR1@120`` sends SIGUSR1 to every task 120 s before),
and preemption or ``scancel`` send SIGTERM, then SIGKILL ``KillWait`` seconds later (30 by default). Python's
default for both is to die at once, losing every step since the last checkpoint. ``mgr.preemption()`` returns a
:class:`Preemption` that catches them instead. Its handler only notes the signal: Python runs a handler between
two bytecodes of whatever the main thread is doing (half way through an optimizer step, inside a collective's
Python part), where nothing can be saved safely.

The loop asks ``stop.requested()`` at a point every rank reaches in step (once per step). A signal can reach the
ranks at different moments, or only some of them (a ``kill`` of one process, one node's daemon slower than
another's), so no rank can decide alone: one that left to save while the others went into the next collective
would leave them waiting there. ``requested()`` is therefore a collective: one MAX allreduce of a one-int buffer
(this rank's signal number, 0 for none), made once in ``every`` calls, so that every rank answers True at the
same call once any rank got a signal, and saves the same step.

A loop that never asks must not make a process immortal: a signal that ``requested()`` has not reported within
``grace`` seconds (default ``UNIDIST_TIMEOUT``) gets its previous meaning back and is raised again (SIGTERM's
default: the process ends), with a line on stderr saying why. A process that never calls ``mgr.preemption()``
keeps Python's default behaviour.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

import torch

from unidist.errors import InvalidArgumentError

__all__ = ["DEFAULT_SIGNALS", "FALLBACK_SECONDS", "SCONTROL_TIMEOUT", "Preemption", "slurm_job"]

DEFAULT_SIGNALS = ("SIGUSR1", "SIGTERM")  # Slurm's usual warning (--signal=USR1@N) and preemption/scancel
# After the grace, the main thread is asked to give the signal its old meaning; one blocked in C that long (a
# collective with a dead peer) cannot run Python: the grace thread then ends the process itself
FALLBACK_SECONDS = 5.0
SCONTROL_TIMEOUT = 60.0  # seconds `scontrol requeue` may take (it asks slurmctld, which may be busy)

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
_installed: Preemption | None = None  # signal handlers belong to the process: one Preemption at a time


class Preemption:
    """Signals noted by a handler, and the collective that turns them into one decision for every rank.

    Made by ``mgr.preemption()``; closed by ``close()`` or when the Manager shuts down.

    Attributes:
        every: ``requested()`` communicates on every ``every``-th call only.
        grace: seconds a noted signal waits for ``requested()`` to report it before it is raised again with its
            previous handler (``math.inf``: never).
    """

    def __init__(self, manager: Any, signals: Iterable[str | int] = DEFAULT_SIGNALS, *, every: int = 1,
                 grace: float | None = None) -> None:
        """Install the handlers (main thread only: Python delivers signals there).

        Args:
            manager: the started Manager whose ranks agree.
            signals: signal names (``"SIGUSR1"`` or ``"USR1"``), numbers or ``signal.Signals`` members.
            every: agree across ranks on every ``every``-th ``requested()`` call (a positive int).
            grace: seconds (> 0, may be ``math.inf``) a signal waits for ``requested()`` before it takes its
                previous meaning again; None: ``UNIDIST_TIMEOUT``.
        """
        global _installed
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("mgr.preemption() must be called from the main thread: Python runs signal "
                                       "handlers there only")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidArgumentError(f"mgr.preemption(every={every!r}) takes a positive int: the number of "
                                       "requested() calls between two agreements")
        if grace is None:
            grace = float(manager.config.timeout)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
            raise InvalidArgumentError(f"mgr.preemption(grace={grace!r}) takes a positive number of seconds "
                                       "(math.inf: never)")
        wanted = _signal_numbers(signals)
        if _installed is not None:
            raise InvalidArgumentError("mgr.preemption() is already handling signals in this process; call close() "
                                       "on the one it returned first (signal handlers belong to the process)")
        self.every = every
        self.grace = float(grace)
        self._mgr = manager
        self._rank = manager.rank
        self._flag = torch.zeros(1, dtype=torch.int32)  # the agreement's buffer, reused: one buffer call on MPI
        self._value = self._flag.numpy()  # the same memory: read and written without a tensor op (~5 us each)
        self._calls = 0
        self._first: int | None = None  # this rank's first signal
        self._received_at: float | None = None
        self._agreed: int | None = None  # the job's signal, once requested() returned True
        self._arrived: set[int] = set()
        self._expired: set[int] = set()  # the grace ran out: the main thread gives these their old meaning
        self._fell_back = threading.Event()
        self._timers: dict[int, threading.Timer] = {}
        self._previous: dict[int, Handler] = {}
        for signum in wanted:
            self._previous[signum] = signal.getsignal(signum)
        try:
            for signum in wanted:
                signal.signal(signum, self._on_signal)
        except BaseException:  # all of them or none
            for signum, old in self._previous.items():
                _restore(signum, old)
            raise
        self._closed = False
        _installed = self

    # ----------------------------------------------------------------- what the loop reads
    def requested(self) -> bool:
        """True on every rank at the same call once any rank got one of the signals; a collective: every rank
        calls it at the same point of its loop (once per step, say).

        Every ``every``-th call exchanges one int with a MAX allreduce; the calls between return False without
        communicating. Once True, it stays True (without communicating).
        """
        if self._agreed is not None:
            return True
        self._calls += 1
        if self._calls % self.every:
            return False
        self._value[0] = self._first or 0
        self._mgr.allreduce_(self._flag, op="max")
        agreed = int(self._value[0])
        if not agreed:
            return False
        self._agreed = agreed
        self._cancel_timers()  # reported: the loop is stopping, as the signal asked
        return True

    @property
    def signal(self) -> str | None:
        """The signal's name (``"SIGUSR1"``): this rank's first until ``requested()`` returned True, then the
        job's, the same on every rank: the highest-numbered of the ranks' first signals, so SIGTERM (15, a
        cancellation) wins over SIGUSR1 (10, a warning); None: none yet."""
        signum = self._agreed or self._first
        return None if signum is None else signal.Signals(signum).name

    @property
    def received_at(self) -> float | None:
        """When this rank's first signal arrived (``time.time()``); None on a rank that got none."""
        return self._received_at

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------------- Slurm
    def requeue(self) -> bool:
        """Put this Slurm batch job back in the queue (``scontrol requeue``, as Lightning does on SIGUSR1): it
        starts again from the top, and the script resumes from ``mgr.latest_checkpoint``. A collective: rank 0
        asks Slurm and every rank returns its answer.

        Call it after the checkpoint is saved: Slurm ends the running job soon after. Call it for the time-limit
        warning (SIGUSR1), not for SIGTERM: that is ``scancel`` (the user wants the job gone) or a preemption,
        which Slurm requeues by itself where its ``PreemptMode`` says REQUEUE. The job must be requeueable:
        ``sbatch --requeue``, or the cluster's ``JobRequeue=1``. Returns True when Slurm accepted; False outside
        a Slurm job (no ``SLURM_JOB_ID``) or when ``scontrol`` failed (rank 0 prints one line with its error).
        """
        done = torch.zeros(1, dtype=torch.int32)
        if self._mgr.rank == 0:
            done[0] = int(_scontrol_requeue(os.environ))
        self._mgr.broadcast_(done, 0)
        return bool(done[0])

    # ----------------------------------------------------------------- leaving
    def close(self) -> None:
        """Restore the handlers that were there before; safe to call twice. The Manager calls it when it shuts
        down. A signal that arrived but that ``requested()`` never reported is named on stderr."""
        global _installed
        if self._closed:
            return
        self._cancel_timers()
        if threading.current_thread() is not threading.main_thread():
            # signal.signal works on the main thread only; the handlers stay, noting signals nobody reads
            print(f"unidist: rank {self._rank}: preemption closed outside the main thread; its signal handlers "
                  "stay installed", file=sys.stderr, flush=True)
        else:
            for signum, old in self._previous.items():
                _restore(signum, old)
        self._closed = True
        if _installed is self:
            _installed = None
        if self._first is not None and self._agreed is None:
            print(f"unidist: rank {self._rank}: {self.signal} arrived but stop.requested() never reported it (the "
                  "loop ended first or never asked)", file=sys.stderr, flush=True)

    # ----------------------------------------------------------------- the handler and its grace
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Note the signal (first arrival of each only: a repeat while one is pending changes nothing). Runs on
        the main thread between two bytecodes: only flags change here."""
        if signum in self._expired:
            self._fall_back(signum)
            return
        if signum in self._arrived:
            return
        self._arrived.add(signum)
        if self._first is None:
            self._first, self._received_at = signum, time.time()
        if self._agreed is None and math.isfinite(self.grace):
            timer = threading.Timer(self.grace, self._expire, args=(signum,))
            timer.daemon = True
            timer.name = f"unidist-preempt-{signal.Signals(signum).name}"
            self._timers[signum] = timer
            timer.start()

    def _expire(self, signum: int) -> None:
        """The grace thread: ``requested()`` did not report ``signum`` in time. Ask the main thread to raise it
        again with its previous handler; if the main thread cannot run Python (blocked in C), end the process
        as SIGTERM's default would."""
        if self._agreed is not None or self._closed:
            return
        name = signal.Signals(signum).name
        print(f"unidist: rank {self._rank}: {name} arrived {self.grace:g} s ago and stop.requested() has not "
              f"reported it (the loop does not call it, or is stuck); raising {name} again with its previous "
              "handler (the default ends the process)", file=sys.stderr, flush=True)
        self._expired.add(signum)
        signal.pthread_kill(threading.main_thread().ident or 0, signum)  # interrupts a sleep or a blocking read
        if self._fell_back.wait(FALLBACK_SECONDS) or self._closed:
            return
        print(f"unidist: rank {self._rank}: the main thread did not run the handler within {FALLBACK_SECONDS:g} s "
              f"(blocked in C); exiting with status {128 + signum}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def _fall_back(self, signum: int) -> None:
        """On the main thread, after the grace: the previous handler back, and the signal raised again."""
        old = self._previous.get(signum)
        _restore(signum, old)
        self._fell_back.set()
        signal.raise_signal(signum)

    def _cancel_timers(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


def _restore(signum: int, old: Handler) -> None:
    """Put back a handler ``signal.getsignal`` returned; None (one installed from C) becomes the default."""
    signal.signal(signum, signal.SIG_DFL if old is None else old)  # type: ignore[arg-type]


_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def _signal_numbers(signals: Iterable[str | int]) -> list[int]:
    """Signal numbers from names (``"SIGTERM"``, ``"TERM"``), numbers or ``signal.Signals``; refused with a
    clear error: an unknown name, one that cannot be caught, none at all."""
    if isinstance(signals, (str, bytes, int)):
        signals = [signals]  # type: ignore[list-item]
    out: list[int] = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.strip().upper()
                sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
            elif isinstance(item, int) and not isinstance(item, bool):
                sig = signal.Signals(item)
            else:
                raise TypeError(item)
        except (KeyError, ValueError, TypeError):
            raise InvalidArgumentError(
                f"mgr.preemption(signals=...): {item!r} is not a signal this system knows; pass names such as "
                "'SIGUSR1' and 'SIGTERM' (see `kill -l`)") from None
        if sig in _UNCATCHABLE:
            raise InvalidArgumentError(f"mgr.preemption(signals=...): {sig.name} cannot be caught by any process")
        if sig not in out:
            out.append(sig)
    if not out:
        raise InvalidArgumentError("mgr.preemption(signals=()) names no signal; the default is "
                                   f"{DEFAULT_SIGNALS}")
    return [int(s) for s in out]


def slurm_job(environ: Mapping[str, str]) -> str | None:
    """The id ``scontrol`` knows this job by (an array task's ``<array job>_<task>``, as Lightning writes it), or
    None outside a Slurm job."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def _scontrol_requeue(environ: Mapping[str, str]) -> bool:
    """Run ``scontrol requeue`` for this job; a failure is one line on stderr, never an exception: the
    checkpoint is saved already, and the job ends cleanly either way."""
    job = slurm_job(environ)
    if job is None:
        return False
    exe = shutil.which("scontrol", path=environ.get("PATH"))
    if exe is None:
        print(f"unidist: cannot requeue Slurm job {job}: scontrol is not on PATH", file=sys.stderr, flush=True)
        return False
    try:
        proc = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"unidist: cannot requeue Slurm job {job}: {err}", file=sys.stderr, flush=True)
        return False
    if proc.returncode != 0:
        said = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}"
        print(f"unidist: scontrol requeue {job} failed (the job needs sbatch --requeue or JobRequeue=1): {said}",
              file=sys.stderr, flush=True)
        return False
    return True
