"""What the layers above need from a communicator: the world (a Manager) or a Group, on any backend.

``Comm`` is what the training layer and tensor parallelism are written on; ``PeerComm`` adds the point-to-point
calls and the blocking broadcast pipeline stages talk over. Both are met by ``Communicator`` (so by every Manager
and Group); code written on them never reads a communicator's private state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from unidist.comm.work import Handle
from unidist.ops import ReduceOp

__all__ = ["Comm", "PeerComm", "world_ranks"]


class Comm(Protocol):
    """The few collectives unidist.train and unidist.parallel's tensor parallel layers are written on."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def allreduce(self, x: torch.Tensor, op: ReduceOp | str = ...) -> torch.Tensor: ...

    def allreduce_(self, x: torch.Tensor, op: ReduceOp | str = ...) -> torch.Tensor: ...

    @property
    def overlaps(self) -> bool: ...

    @property
    def reduce_alone_from(self) -> float: ...

    def allreduce_async_(self, x: torch.Tensor, op: ReduceOp | str = ...) -> Handle[torch.Tensor]: ...

    def allgather(self, x: torch.Tensor, out: torch.Tensor | None = ...) -> torch.Tensor: ...

    def allgather_async(self, x: torch.Tensor, out: torch.Tensor | None = ...) -> Handle[torch.Tensor]: ...

    def alltoall(self, x: torch.Tensor, splits: Sequence[int] | None = ..., out: torch.Tensor | None = ...
                 ) -> torch.Tensor: ...

    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp | str = ...) -> Handle[torch.Tensor]: ...

    def broadcast_(self, x: torch.Tensor, root: int = ...) -> torch.Tensor: ...

    def broadcast_object(self, obj: Any, root: int = ...) -> Any: ...


class PeerComm(Comm, Protocol):
    """``Comm`` and what a pipeline's stages exchange: activations and gradients between neighbours (blocking
    send/recv, this communicator's ranks), the loss from the last stage."""

    def send(self, x: torch.Tensor, dest: int, tag: int = ...) -> None: ...

    def recv(self, x: torch.Tensor, source: int, tag: int = ...) -> torch.Tensor: ...

    def broadcast(self, x: torch.Tensor, root: int = ...) -> torch.Tensor: ...


def world_ranks(comm: Comm) -> tuple[int, ...]:
    """The world ranks of ``comm``'s members, in its rank order: a Group's ``ranks``, or the whole world."""
    ranks = getattr(comm, "ranks", None)
    return tuple(ranks) if ranks is not None else tuple(range(comm.size))
