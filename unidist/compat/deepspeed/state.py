"""The compat layer's run: the started unidist Manager behind ``deepspeed.*``.

The bottom of ``unidist.compat.deepspeed``: ``init_distributed`` and ``initialize`` call ``manager()``, which
uses the Manager of an enclosing ``with unidist.init()`` block, or starts the one unidist selects for this launch
(and shuts it down at exit), as ``deepspeed.init_distributed`` would start torch.distributed.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

__all__ = ["engine_of", "manager", "register_engine", "running"]


class _State:
    __slots__ = ("atexit_registered", "engines", "mgr")

    def __init__(self) -> None:
        self.mgr: Any = None
        self.atexit_registered = False
        self.engines: weakref.WeakSet[Any] = weakref.WeakSet()  # the engines initialize made (deepspeed.zero)


_state = _State()


def running() -> Any:
    """The started Manager (ours or an enclosing ``with unidist.init()`` block's), or None."""
    from unidist.errors import NotInitializedError
    from unidist.managers.base import get_manager

    if _state.mgr is not None and _state.mgr.started:
        return _state.mgr
    try:
        return get_manager()
    except NotInitializedError:
        return None


def manager() -> Any:
    """The started Manager; starts the one unidist selects when none is running."""
    mgr = running()
    if mgr is not None:
        return mgr
    import unidist

    _state.mgr = unidist.init().start()
    if not _state.atexit_registered:
        atexit.register(_at_exit)
        _state.atexit_registered = True
    return _state.mgr


def _at_exit() -> None:
    """Shut our Manager down at exit. After an uncaught exception (``sys.last_value``) leave as a failed ``with
    unidist.init()`` block does: end the job where the engine can, without the leaving barrier the peers (waiting
    in some collective) would never reach."""
    mgr, _state.mgr = _state.mgr, None
    if mgr is None or not mgr.started:
        return
    exc = getattr(sys, "last_value", None)
    if exc is None:
        mgr.shutdown()
    else:
        mgr.__exit__(type(exc), exc, exc.__traceback__)


def register_engine(engine: Any) -> None:
    """Remember an engine ``initialize`` made, so ``deepspeed.zero.GatheredParameters(params)`` finds its module."""
    _state.engines.add(engine)


def engine_of(params: list[Any]) -> Any:
    """The live engine whose module holds any of ``params``, or None."""
    ids = {id(p) for p in params}
    for engine in list(_state.engines):
        if any(id(p) in ids for p in engine.module.parameters()):
            return engine
    return None
