"""Background checkpoints: the files written by a thread while training goes on, published at ``wait()``.

Who does what, and why:

- ``save_async`` (every rank, on the training thread, before it returns): the collective start of the save
  (``unidist.checkpoint.stage``): agreement on the temporary directory, this rank's slices copied to host memory
  (the snapshot: training may change the parameters as soon as it returns), ``meta.pt`` serialized on rank 0.
- the writer thread (this rank alone): this rank's shard (and rank 0's ``meta.pt``) written, fsynced and hashed
  (``unidist.checkpoint.write``). It runs **no collective**: a collective on a second thread would interleave
  with the training thread's collectives on the same communicator, which deadlocks or mismatches on MPI and
  gloo (and confuses the watchdog's call count). torch.distributed.checkpoint's ``async_save`` takes a process
  group for its own collectives (a gloo group beside NCCL's); not every engine here has a second communicator
  that is safe to use from another thread (MPI needs THREAD_MULTIPLE, Horovod has one background loop).
- ``SaveHandle.wait()`` (every rank, on the training thread): the collective end (``unidist.checkpoint.finish``):
  the ranks agree that every shard was written (a failure on any rank is raised on every rank, typed), rank 0
  writes the manifest, the directory is renamed into place, old checkpoints go (``keep``).

So the checkpoint appears only when every rank has called ``wait()``, and until then ``latest_checkpoint``
returns the previous one; a process killed mid-write leaves a temporary directory without a manifest, which is
never taken for a checkpoint and is swept by the next save with ``keep=``. The training layer calls ``wait()``
itself before the next save or load and when the Manager shuts down (unidist/train/trainer.py), so a forgotten
``wait()`` never loses a checkpoint silently. One save is in flight at a time, as with ``async_save``.

While training runs beside it and no core is idle (the 1-minute load average + 1 exceeds the usable CPUs), the
writer is paced: it writes at most ``WRITER_DUTY`` of the time (after a 1 MiB slice that took t seconds it sleeps
t * (1 - duty) / duty), at a lower CPU priority (``WRITER_NICE``, Linux). A background save needs the same CPU
as a blocking one, so where every core trains it can only spread that cost: measured (25.2 M parameters with
Adam, 288 MiB), each step while the writer runs pays about its total work divided by the steps it spans. A
lower priority alone did not help (2 MPI ranks on 2 loaded cores: 1.5-1.7x a normal step with the writer at
nice 19); a fifth of the time gave 0.9-1.5x on 2 ranks and 1.31x on one process over 22 steps, a tenth
0.96-1.25x on 2 ranks, a twentieth (the default) 1.00x and 0.95x, the save then spanning ~14 steps (4.8 s for
288 MiB, against 0.46 s waited for at once). Where a core is idle (a GPU job's host), it writes at full speed.
Once ``wait()`` is called the training thread is waiting anyway, and the writer goes at full speed: a save waited
for at once is as fast as a blocking one.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from unidist.checkpoint import Staged, World, finish, stage, write
from unidist.checkpoint.layout import Layout
from unidist.errors import CheckpointError

__all__ = ["WRITER_DUTY", "WRITER_NICE", "SaveHandle", "save_async"]

WRITER_NICE = 10  # added to the process's nice value for the writer thread (the training thread keeps its own)
WRITER_DUTY = 0.05  # the share of the time the writer writes until wait(), when no core is idle (1: never paced)


def _cores_busy() -> bool:
    """Whether no core is idle for the writer (Linux's 1-minute load average + 1 > usable CPUs); unknown: busy."""
    try:
        return os.getloadavg()[0] + 1 > len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return True


class _Pace:
    """The writer's throttle: sleeps after each slice so it writes ``WRITER_DUTY`` of the time while no core is
    idle (looked at twice a second), until ``hurry()`` (wait() was called: nothing trains on this rank), which
    also ends a sleep at once."""

    def __init__(self) -> None:
        self.hurried = threading.Event()
        self.busy, self.looked = True, -1.0

    def __call__(self, seconds: float) -> None:
        duty = WRITER_DUTY
        if not 0 < duty < 1 or self.hurried.is_set():
            return
        now = time.monotonic()
        if now - self.looked >= 0.5:
            self.busy, self.looked = _cores_busy(), now
        if self.busy:
            self.hurried.wait(seconds * (1 - duty) / duty)

    def hurry(self) -> None:
        self.hurried.set()


def _lower_priority() -> None:
    """This thread only (Linux schedules threads as tasks: setpriority on its native id); elsewhere a no-op."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except (AttributeError, OSError):
        pass


class SaveHandle:
    """A checkpoint being written in the background (``save_checkpoint(..., blocking=False)``).

    ``wait()`` publishes it and returns its path: every rank must call it (it runs collectives), in the same
    order as its other collectives, as with any collective call; the next ``save_checkpoint`` or
    ``load_checkpoint`` and the Manager's shutdown call it for you. ``done()`` says whether this rank's files are
    written (``wait()`` then blocks only for the short collective end)."""

    def __init__(self, mgr: World, staged: Staged) -> None:
        self.path: Path = staged.final
        self._mgr = mgr
        self._staged = staged
        self._rank, self._size = mgr.rank, mgr.size
        self._result: tuple[dict[str, Any] | None, BaseException | None] | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._pace = _Pace()
        self._thread = threading.Thread(target=self._write, name=f"unidist-checkpoint {self.path.name}",
                                         daemon=True)  # an unpublished write is worth nothing once the job ends
        self._thread.start()

    def _write(self) -> None:
        _lower_priority()
        self._result = write(self._staged, self._rank, self._size, self._pace)  # never raises: errors are returned

    def done(self) -> bool:
        """Whether this rank's files are written (or failed); no collective, never blocks."""
        return not self._thread.is_alive()

    @property
    def finished(self) -> bool:
        """Whether ``wait()`` has run to its end on this rank (published, or raised)."""
        return self._finished

    @property
    def published(self) -> bool:
        """Whether the checkpoint is in place (``wait()`` returned)."""
        return self._finished and self._error is None

    def wait(self) -> Path:
        """Block until this rank's files are written, then publish with every other rank (collective); returns
        the checkpoint's path. A failure on any rank raises on every rank (a ``CheckpointError`` subclass, the
        writer's error as its message) and leaves the previous checkpoint in place. Calling it again returns the
        path again, or raises the same error."""
        if not self._finished:
            self._pace.hurry()
            self._thread.join()
            info, problem = self._result if self._result is not None else (
                None, CheckpointError(f"rank {self._rank}: the background writer of {self.path} ended without a "
                                      "result"))
            try:
                finish(self._mgr, self._staged, info, problem)
            except BaseException as err:
                self._error = err
                raise
            finally:
                self._finished = True
        if self._error is not None:
            raise self._error
        return self.path

    def abandon(self) -> None:
        """Give the save up without a collective (the job is failing): the writer is left to end, nothing is
        published, and the previous checkpoint stays the latest. The temporary directory is swept by the next
        save with ``keep=``."""
        self._finished = True
        self._error = CheckpointError(f"the background save of {self.path} was abandoned: the job failed first")

    def __repr__(self) -> str:
        state = "published" if self.published else "failed" if self._finished else \
            "written, not yet published" if self.done() else "writing"
        return f"SaveHandle({str(self.path)!r}, {state})"


def save_async(mgr: World, path: str | os.PathLike[str], layout: Layout, *, keep: int | None = None,
               extra: dict[str, Any] | None = None) -> SaveHandle:
    """Start a background save: the collective start now (the snapshot), this rank's files on a thread; every
    rank calls it, then ``wait()`` on the handle (or lets the training layer do so). See the module docstring."""
    return SaveHandle(mgr, stage(mgr, path, layout, keep=keep, extra=extra))
