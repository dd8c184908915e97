"""Group: the collective API over a subset of the world's ranks.

``Manager.new_group(ranks)`` and ``Manager.split(color, key)`` make them with each engine's own mechanism
(MPI sub-communicators, torch/DeepSpeed ``new_group``, Horovod process sets); a Group of one rank needs no
engine at all. Every collective takes and returns group ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unidist.comm import watchdog
from unidist.comm.collectives import Collectives
from unidist.comm.primitives import Primitives
from unidist.errors import InvalidArgumentError, NotInitializedError

__all__ = ["Group", "SoloComm", "SoloGroup", "SortedOrder"]


class Group(Collectives):
    """Members' world ranks in group order are ``ranks``; ``rank`` and ``size`` are within the group."""

    def __init__(self, owner: Any, ranks: Sequence[int]) -> None:
        self._owner = owner  # the Manager: its config, device and lifetime are the group's
        self.config = owner.config
        self._device = owner._device
        self._ranks = tuple(ranks)
        self._rank = self._ranks.index(owner._rank)
        self._size = len(self._ranks)
        self._init_collectives()
        self._enable_fast_path()
        if self._size > 1:
            watchdog.watch_primitives(self, "group ")

    @property
    def ranks(self) -> tuple[int, ...]:
        """The members' world ranks, in group order."""
        return self._ranks

    @property
    def device(self) -> torch.device:
        return self._device

    def _need_started(self) -> None:
        if not self._owner._started:
            raise NotInitializedError("this Group's Manager has shut down; groups live inside its `with` block")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self._rank}/{self._size} of world ranks {list(self._ranks)}>"


class SortedOrder:
    """For engines that order a group's members by world rank whatever order they were given in (torch and
    DeepSpeed ``new_group``, Horovod process sets): a Group ordered otherwise (``split`` with a key) has its
    per-rank chunks permuted on the way into and out of allgather, alltoall and reduce_scatter."""

    _perm: tuple[int, ...] | None = None  # the engine's (sorted) position -> group rank, when they differ

    def _set_order(self, ranks: Sequence[int]) -> None:
        order = sorted(ranks)
        self._perm = None if order == list(ranks) else tuple(list(ranks).index(w) for w in order)

    def _permuted(self, counts: Sequence[int]) -> list[int]:
        """Per-group-rank counts, listed in the engine's order."""
        return list(counts) if self._perm is None else [counts[g] for g in self._perm]

    def _to_engine_order(self, flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Chunks in group-rank order (sizes ``counts``) rearranged into the engine's order."""
        if self._perm is None:
            return flat
        parts = list(torch.split(flat, list(counts)))
        return torch.cat([parts[g] for g in self._perm])

    def _from_engine_order(self, flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Chunks in the engine's order rearranged into group-rank order (``counts`` per group rank)."""
        if self._perm is None:
            return flat
        parts = dict(zip(self._perm, torch.split(flat, self._permuted(counts)), strict=True))
        return torch.cat([parts[g] for g in range(len(counts))])


class SoloComm(Primitives):
    """Primitives of a one-rank communicator: every collective is a copy, send/recv go through a mailbox."""

    def _barrier(self) -> None:
        return None

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        return None

    def _allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: Any) -> None:
        if send is not recv:
            recv.copy_(send)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        recv.view(-1).copy_(send.view(-1))

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        recv.view(-1).copy_(send.view(-1)[: recv_counts[0]])

    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._mailbox().setdefault(tag, []).append(t.clone())

    def _recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        box = self._mailbox().get(tag)
        if not box:
            raise InvalidArgumentError(f"recv(tag={tag}) on a one-rank communicator with no matching send: it "
                                       "would wait forever")
        msg = box.pop(0)
        if msg.shape != t.shape or msg.dtype != t.dtype:
            raise InvalidArgumentError(f"recv buffer {tuple(t.shape)} {t.dtype} does not match the message "
                                       f"{tuple(msg.shape)} {msg.dtype}")
        t.copy_(msg)

    def _mailbox(self) -> dict[int, list[torch.Tensor]]:
        box: dict[int, list[torch.Tensor]] = self.__dict__.setdefault("_box", {})
        return box


class SoloGroup(SoloComm, Group):
    """A group of one rank, on any backend: no engine call at all."""
