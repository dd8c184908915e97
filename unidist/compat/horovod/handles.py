"""Horovod's int handles: the module map behind ``poll`` and ``synchronize``, and in-flight names.

``synchronize`` pops a handle and returns its output (for ``alltoall_async`` the pair (output,
received_splits)); an unknown or already synchronized handle gives None and ``poll`` on it a ValueError, as
in Horovod. A name may not be reused while an op of that name is in flight (Horovod's ValueError).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.compat.horovod.core import Pending
from unidist.errors import InvalidArgumentError

__all__ = ["claim", "poll", "register", "reset", "run", "synchronize"]

_handles: dict[int, Pending] = {}
_names: dict[str, int] = {}
_next = [1]


def reset() -> None:
    """Forget every handle (init and shutdown, as Horovod's handle map)."""
    _handles.clear()
    _names.clear()


def claim(name: str | None) -> None:
    """Refuse a name an in-flight op holds (Horovod's ValueError)."""
    if name is not None and name in _names:
        raise InvalidArgumentError(
            "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that "
            "is currently being processed.  If you want to request another tensor, use a different tensor name.")


def register(start: Callable[..., Pending], *args: Any) -> int:
    """Start an op (``start(*args)``, the name last) and return its handle."""
    name = args[-1]
    claim(name)
    pending = start(*args)
    pending.name = name  # eager starts (grouped, alltoall, Adasum) make theirs without one: free it at synchronize
    handle = _next[0]
    _next[0] += 1
    _handles[handle] = pending
    if name is not None:
        _names[name] = handle
    return handle


def run(start: Callable[..., Pending], *args: Any) -> Any:
    """Start an op and wait for it: the blocking calls."""
    claim(args[-1])
    return start(*args).wait()


def poll(handle: int) -> bool:
    """Whether the op behind ``handle`` finished (``synchronize`` then returns at once)."""
    pending = _handles.get(handle)
    if pending is None:
        raise InvalidArgumentError(f"Handle {handle} was not created or has been cleared.")
    return pending.done()


def synchronize(handle: int) -> Any:
    """Wait for the op behind ``handle`` and return its output; None for an unknown handle (Horovod's)."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    if pending.name is not None:
        _names.pop(pending.name, None)
    return pending.wait()
