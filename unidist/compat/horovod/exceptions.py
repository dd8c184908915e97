"""Horovod's exception types, so ``except hvd.HorovodInternalError`` in a script catches what it did before.

Both are unidist errors too: ``HorovodInternalError`` is what a collective failing inside the engine becomes
under ``hvd.elastic.run``; ``HostsUpdatedInterrupt`` is raised by ``State.check_host_updates`` when the set
of hosts changed (elastic.py).
"""

from __future__ import annotations

from unidist.errors import UnidistError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "OptimizerProtocolError"]


class HorovodInternalError(UnidistError, RuntimeError):
    """A collective failed inside the engine (a peer died or the job is ending): Horovod's name for it."""


class HostsUpdatedInterrupt(UnidistError, RuntimeError):  # noqa: N818  (Horovod's name)
    """The set of hosts changed; ``hvd.elastic.run`` resynchronises state and goes on. ``skip_sync`` as
    Horovod's: True when only hosts were added and the state needs no restore."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync


class OptimizerProtocolError(UnidistError, AssertionError):
    """A DistributedOptimizer call came at the wrong point of the step (Horovod raises AssertionError there):
    ``zero_grad()`` between ``backward()`` and ``step()``/``synchronize()``, or more backward passes than
    ``backward_passes_per_step`` before ``step()``."""
