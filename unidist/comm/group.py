"""Group: the collective API over a subset of the world's ranks — the one Communicator over a sub-engine.

``Manager.new_group(ranks)`` and ``Manager.split(color, key)`` make them from ``engine.sub(lists)``: each
engine's own mechanism (MPI sub-communicators, torch/DeepSpeed ``new_group``, Horovod process sets), and a
one-rank group is a SoloEngine on every backend. Every collective takes and returns group ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unidist.comm.communicator import Communicator
from unidist.comm.engine import Engine, SoloEngine, SortedOrder
from unidist.errors import NotInitializedError

__all__ = ["Group", "SoloEngine", "SortedOrder"]


class Group(Communicator):
    """Members' world ranks in group order are ``ranks``; ``rank`` and ``size`` are within the group.

    Its config, device and lifetime are its Manager's (``owner``): it works inside the Manager's ``with``
    block only.
    """

    def __init__(self, owner: Any, ranks: Sequence[int], engine: Engine) -> None:
        self._owner = owner  # the Manager
        self.config = owner.config
        self._device = owner.device
        self._ranks = tuple(ranks)
        self._init_collectives()
        self._bind(engine)
        self._enable_fast_path()

    @property
    def owner(self) -> Any:
        """The Manager that made this group (its config, device and lifetime are the Manager's)."""
        return self._owner

    def close(self) -> None:
        """Called by its Manager at shutdown: later calls leave the fast path and find the Manager stopped."""
        self._disable_fast_path()

    @property
    def ranks(self) -> tuple[int, ...]:
        """The members' world ranks, in group order."""
        return self._ranks

    @property
    def device(self) -> torch.device:
        return self._device

    def _need_started(self) -> None:
        if not self._owner.started:
            raise NotInitializedError("this Group's Manager has shut down; groups live inside its `with` block")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self._rank}/{self._size} of world ranks {list(self._ranks)}>"
