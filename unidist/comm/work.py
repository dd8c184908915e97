"""Work and Handle: in-flight operations.

An engine returns its own request object (an MPI request, a torch Work, a Horovod handle); ``EngineWork``
adapts each to one ``Work`` protocol and holds every buffer the operation reads or writes until it ends.
``Handle`` is what a user's ``*_async`` call returns: ``wait()`` completes the work and returns the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

__all__ = ["DONE", "Array", "EngineWork", "Handle", "Work"]

Array = TypeVar("Array", torch.Tensor, np.ndarray)


class Work(Protocol):
    """An engine's in-flight operation."""

    def wait(self) -> None: ...
    def test(self) -> bool: ...


class _Done:
    __slots__ = ()

    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


DONE: Work = _Done()


class EngineWork:
    """An engine's in-flight request as a Work; holds the buffers so they outlive the operation."""

    __slots__ = ("_keep", "_test", "_wait")

    def __init__(self, wait: Callable[[], object], test: Callable[[], object], *keep: object) -> None:
        self._wait, self._test, self._keep = wait, test, keep

    def wait(self) -> None:
        self._wait()

    def test(self) -> bool:
        return bool(self._test())


class Handle(Generic[Array]):
    """Result of an ``*_async`` call: ``wait()`` completes it and returns the result."""

    __slots__ = ("_finish", "_result", "_work")

    def __init__(self, work: Work, finish: Callable[[], Array]) -> None:
        self._work: Work | None = work
        self._finish: Callable[[], Array] = finish
        self._result: Array | None = None

    def done(self) -> bool:
        """True once the operation finished (``wait`` then returns at once)."""
        return self._work is None or self._work.test()

    def wait(self) -> Array:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._result = self._finish()
        return self._result  # type: ignore[return-value]
