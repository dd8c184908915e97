"""The compat layer's run: the started Manager behind ``hvd`` and the topology derived at init.

The bottom of ``unidist.compat.horovod``: every module asks ``manager()`` for the Manager, which raises
Horovod's not-initialized ValueError before ``hvd.init()``.
"""

from __future__ import annotations

from typing import Any

from unidist.errors import NotInitializedError, UnidistError

__all__ = ["HorovodNotInitializedError", "UnsupportedFeatureError", "manager", "state"]

NOT_INIT = "Horovod has not been initialized; use hvd.init()."


class HorovodNotInitializedError(NotInitializedError, ValueError):
    """Horovod's ``ValueError('Horovod has not been initialized; use hvd.init().')``, also unidist's
    NotInitializedError: ``except ValueError`` in a Horovod script keeps working."""


class UnsupportedFeatureError(UnidistError, ValueError):
    """A Horovod argument this layer cannot honour on unidist (e.g. ``init(comm=<mpi4py communicator>)``);
    the message says what to do instead."""


class _State:
    """This process's run: the started Manager and the topology derived once at init."""

    __slots__ = ("atexit_registered", "cross", "homogeneous", "mgr", "owned")

    def __init__(self) -> None:
        self.mgr: Any = None
        self.owned = True  # started by hvd.init (else a `with unidist.init()` block's, which ends it)
        self.cross = (-1, -1)
        self.homogeneous = False
        self.atexit_registered = False


state = _State()


def manager() -> Any:
    """The started Manager behind ``hvd``; raises Horovod's not-initialized error before ``init()``."""
    mgr = state.mgr
    if mgr is None or not mgr.started:
        raise HorovodNotInitializedError(NOT_INIT)
    return mgr
