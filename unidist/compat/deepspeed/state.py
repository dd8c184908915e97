"""The compat layer's run: the started unidist Manager behind ``deepspeed.*``.

The bottom of ``unidist.compat.deepspeed``: ``init_distributed`` and ``initialize`` call ``manager()``, which
uses the Manager of an enclosing ``with unidist.init()`` block, or starts the one unidist selects for this launch
(and shuts it down at exit), as ``deepspeed.init_distributed`` would start torch.distributed.
"""

from __future__ import annotations

import atexit
from typing import Any

__all__ = ["manager", "running"]


class _State:
    __slots__ = ("atexit_registered", "mgr")

    def __init__(self) -> None:
        self.mgr: Any = None
        self.atexit_registered = False


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
    mgr, _state.mgr = _state.mgr, None
    if mgr is not None and mgr.started:
        mgr.shutdown()
