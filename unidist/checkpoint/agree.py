"""What saving and loading agree over: the world communicator, and failing on every rank at once.

A rank that fails alone while the others wait in the next collective would hang the job until the timeout;
every step of a save or load that can fail on some ranks only is followed by ``agree``.
"""

from __future__ import annotations

from typing import Any, Protocol

from unidist.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointMissingError,
    InvalidArgumentError,
)

__all__ = ["World", "agree"]

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
