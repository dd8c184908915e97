"""What saving and loading agree over: the world communicator, and failing on every rank at once.

A rank that fails alone while the others wait in the next collective would hang the job until the timeout;
every step of a save or load that can fail on some ranks only is followed by ``agree``.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from unidist.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointMissingError,
    InvalidArgumentError,
)

__all__ = ["World", "agree", "agree_or_discard", "temporary_beside"]

_ERRORS = {cls.__name__: cls for cls in (CheckpointError, CheckpointMismatchError, CheckpointCorruptError,
                                         CheckpointMissingError, InvalidArgumentError)}


class World(Protocol):
    """The whole job's communicator (a Manager): what saving and loading agree over."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def backend(self) -> str: ...

    def broadcast_object(self, obj: Any, root: int = ...) -> Any: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


def agree(mgr: World, problem: BaseException | None) -> None:
    """Raise on every rank if any rank failed (the first rank's error, same type), so nobody waits alone."""
    seen = mgr.allgather_object(None if problem is None else (type(problem).__name__, str(problem)))
    for rank, item in enumerate(seen):
        if item is not None:
            if problem is not None:
                raise problem
            cls = _ERRORS.get(item[0], CheckpointError)
            raise cls(f"rank {rank}: {item[1]}")


def agree_or_discard(mgr: World, problem: BaseException | None, tmp: Path) -> None:
    """``agree``, and when any rank failed, rank 0 removes the temporary directory ``tmp`` before raising."""
    try:
        agree(mgr, problem)
    except BaseException:
        if mgr.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def temporary_beside(mgr: World, final: Path) -> Path:
    """A new temporary directory beside ``final``, one name on every rank, created by rank 0 (every rank learns
    whether that failed): where a save writes before its atomic rename."""
    tmp: Path = final.parent / str(mgr.broadcast_object(f".{final.name}.tmp-{time.time_ns()}-{os.getpid()}"))
    problem: BaseException | None = None
    try:
        if mgr.rank == 0:
            tmp.mkdir(parents=True)
    except OSError as err:
        problem = CheckpointError(f"cannot create {tmp}: {err}")
    agree(mgr, problem)
    return tmp
