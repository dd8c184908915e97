"""The engine primitives: what a backend implements, on contiguous torch tensors, for one communicator.

Seven are required; gather, scatter, reduce_scatter and the async variants have correct derived defaults that
an engine with a native call overrides. Counts are element counts per rank of this communicator, and ranks
(root, dest, source) are ranks of this communicator: a group's primitives translate them if the engine wants
world ranks.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch

from unidist.comm.work import DONE, EngineWork, Work
from unidist.ops import ReduceOp

__all__ = ["Primitives"]


class Primitives(abc.ABC):
    """The engine side of a communicator."""

    # dtypes the engine cannot reduce natively -> the wider dtype they are reduced in (then cast back once)
    _upcast_reduce: ClassVar[Mapping[torch.dtype, torch.dtype]] = {}
    # dtypes the engine cannot move -> a same-size dtype whose bits it moves unchanged (no arithmetic)
    _wire_dtypes: ClassVar[Mapping[torch.dtype, torch.dtype]] = {}
    _rank: int
    _size: int

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        """In place on a contiguous tensor."""

    @abc.abstractmethod
    def _allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        """``send is recv`` means in place. op is SUM, MIN, MAX or PRODUCT on a natively reducible dtype."""

    @abc.abstractmethod
    def _allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        """recv (flat, contiguous) gets every rank's send; counts are element counts per rank."""

    @abc.abstractmethod
    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        """Element counts per peer; chunks laid out in rank order in both buffers."""

    @abc.abstractmethod
    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None: ...

    @abc.abstractmethod
    def _recv(self, t: torch.Tensor, source: int, tag: int) -> None: ...

    # Derived primitives: correct on every backend, overridden where the engine has a native call.
    def _gather(self, send: torch.Tensor, recv: torch.Tensor | None, counts: Sequence[int], root: int) -> None:
        zeros = [0] * self._size
        send_counts = list(zeros)
        send_counts[root] = send.numel()
        recv_counts = list(counts) if self._rank == root else zeros
        out = recv if recv is not None else send.new_empty(0)
        self._alltoall(send, out, send_counts, recv_counts)

    def _scatter(self, send: torch.Tensor | None, recv: torch.Tensor, counts: Sequence[int], root: int) -> None:
        zeros = [0] * self._size
        recv_counts = list(zeros)
        recv_counts[root] = recv.numel()
        src = send if send is not None else recv.new_empty(0)
        self._alltoall(src, recv, list(counts) if self._rank == root else zeros, recv_counts)

    def _reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                        op: ReduceOp) -> None:
        full = torch.empty_like(send)
        self._allreduce(send, full, op)
        start = sum(counts[: self._rank])
        recv.view(-1).copy_(full.view(-1)[start:start + recv.numel()])

    def _allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        self._allreduce(send, recv, op)
        return DONE

    def _reduce_scatter_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                              op: ReduceOp) -> Work:
        """An async allreduce of the whole input; this rank's chunk is copied out when it ends."""
        full = torch.empty_like(send)
        work = self._allreduce_async(send, full, op)
        start = sum(counts[: self._rank])

        def finish() -> None:
            work.wait()
            recv.view(-1).copy_(full.view(-1)[start:start + recv.numel()])
        return EngineWork(finish, work.test, send, recv, full)

    def _broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        self._broadcast(t, root)
        return DONE

    def _allgather_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Work:
        self._allgather(send, recv, counts)
        return DONE

    # ------------------------------------------------------------ the desync check's own traffic (comm/check.py)
    _check_buf: torch.Tensor  # two int64 words

    def _check_exchange(self) -> None:
        """MAX allreduce of ``_check_buf`` in place. Engines with a communicator to spare move it there, so a
        check can never match a data call of a desynchronised peer."""
        self._allreduce(self._check_buf, self._check_buf, ReduceOp.MAX)

    def _check_exchange_async(self) -> Callable[[], object] | None:
        """Start ``_check_exchange`` to overlap it with the call it checks and return its wait; None where the
        check and the data share one channel (then the check must end before the data call starts)."""
        return None

    def _check_rows(self, mine: torch.Tensor, table: torch.Tensor) -> Work:
        """Start an allgather of every rank's check row (int64) after a mismatch."""
        self._allgather(mine, table, [mine.numel()] * self._size)
        return DONE
