"""Engine: what a backend implements — its primitives on contiguous torch tensors, for one communicator.

A backend's engine object is all the collective layer knows of it: ``comm.Communicator`` (the world's Manager,
every Group) holds one and writes every public collective on it once. Seven primitives are required; gather,
scatter, reduce_scatter and the async variants have correct derived defaults that an engine with a native call
overrides. Counts are element counts per rank of this communicator, and ranks (root, dest, source) are ranks of
this communicator: an engine translates them if its library wants world ranks.

Groups are sub-engines: ``engine.sub(lists)`` makes them with the library's own mechanism (``_split``), and a
one-rank group is a ``SoloEngine`` on every backend. ``abort`` is how the job ends when one rank cannot go on.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from unidist.comm.work import DONE, EngineWork, Work
from unidist.errors import InvalidArgumentError, UnidistError
from unidist.ops import ReduceOp

__all__ = ["Engine", "SoloEngine", "SortedOrder"]

_INT64 = torch.int64


class Engine(abc.ABC):
    """The primitives of one communicator of ``size`` ranks, this process being ``rank``."""

    # dtypes the engine cannot reduce natively -> the wider dtype they are reduced in (then cast back once)
    upcast_reduce: ClassVar[Mapping[torch.dtype, torch.dtype]] = {}
    # dtypes the engine cannot move -> a same-size dtype whose bits it moves unchanged (no arithmetic)
    wire_dtypes: ClassVar[Mapping[torch.dtype, torch.dtype]] = {}
    # True where ``abort`` ends every rank of the job (MPI_Abort); elsewhere a failing rank just exits
    aborts_job: ClassVar[bool] = False
    # True where a collective started by an ``*_async`` call moves on while the caller computes (gloo's and
    # Horovod's threads do); False where it moves only inside the caller's test/wait (MPI without a progress
    # thread), so starting it early overlaps nothing and only puts several collectives in flight at once
    progresses_alone: ClassVar[bool] = True
    # gradients of at least this many bytes are reduced where they are, in their own call, rather than copied into
    # a fusion bucket: worth it where a call costs less than copying that many bytes (shared memory), never where a
    # call costs a millisecond (gloo, Horovod)
    reduce_alone_from: ClassVar[float] = math.inf

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        # the desync check's three int64 words (comm/check.py: signature, its negation, the next check's
        # distance); engines that check on a channel of their own keep a persistent request on this very buffer
        self.check_buf = torch.zeros(3, dtype=_INT64)
        self.check_np = self.check_buf.numpy()

    # ------------------------------------------------------------ required primitives
    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """In place on a contiguous tensor."""

    @abc.abstractmethod
    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        """``send is recv`` means in place. op is SUM, MIN, MAX or PRODUCT on a natively reducible dtype."""

    @abc.abstractmethod
    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        """recv (flat, contiguous) gets every rank's send; counts are element counts per rank."""

    @abc.abstractmethod
    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                 recv_counts: Sequence[int]) -> None:
        """Element counts per peer; chunks laid out in rank order in both buffers."""

    @abc.abstractmethod
    def send(self, t: torch.Tensor, dest: int, tag: int) -> None: ...

    @abc.abstractmethod
    def recv(self, t: torch.Tensor, source: int, tag: int) -> None: ...

    # ------------------------------------------------------------ derived primitives (native calls override)
    def reduce(self, send: torch.Tensor, recv: torch.Tensor, root: int, op: ReduceOp) -> None:
        """Every rank's ``send`` reduced elementwise into root's ``recv`` (scratch on the other ranks). Written here
        on ``allreduce`` (every rank receives the result, the others drop it); an engine with a reduce of its own
        overrides it (MPI's Reduce, torch.distributed's reduce), so that only the root receives."""
        self.allreduce(send, recv, op)

    def gather(self, send: torch.Tensor, recv: torch.Tensor | None, counts: Sequence[int], root: int) -> None:
        zeros = [0] * self.size
        send_counts = list(zeros)
        send_counts[root] = send.numel()
        recv_counts = list(counts) if self.rank == root else zeros
        out = recv if recv is not None else send.new_empty(0)
        self.alltoall(send, out, send_counts, recv_counts)

    def scatter(self, send: torch.Tensor | None, recv: torch.Tensor, counts: Sequence[int], root: int) -> None:
        zeros = [0] * self.size
        recv_counts = list(zeros)
        recv_counts[root] = recv.numel()
        src = send if send is not None else recv.new_empty(0)
        self.alltoall(src, recv, list(counts) if self.rank == root else zeros, recv_counts)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], op: ReduceOp) -> None:
        full = torch.empty_like(send)
        self.allreduce(send, full, op)
        start = sum(counts[: self.rank])
        recv.view(-1).copy_(full.view(-1)[start:start + recv.numel()])

    def allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        self.allreduce(send, recv, op)
        return DONE

    def reduce_scatter_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                             op: ReduceOp) -> Work:
        """An async allreduce of the whole input; this rank's chunk is copied out when it ends."""
        full = torch.empty_like(send)
        work = self.allreduce_async(send, full, op)
        start = sum(counts[: self.rank])

        def finish() -> None:
            work.wait()
            recv.view(-1).copy_(full.view(-1)[start:start + recv.numel()])
        return EngineWork(finish, work.test, send, recv, full)

    def broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        self.broadcast(t, root)
        return DONE

    def allgather_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Work:
        self.allgather(send, recv, counts)
        return DONE

    def prepared_sum(self, t: torch.Tensor) -> Any:
        """What ``allreduce_prepared`` needs to sum ``t`` in place (contiguous, a natively reduced dtype), made
        once and kept by the communicator under t's address, size and dtype; None where the engine has no such
        shortcut (its ``allreduce`` is then called every time)."""
        return None

    def allreduce_prepared(self, t: torch.Tensor, prepared: Any, op: ReduceOp) -> None:
        """Sum ``t`` in place with what ``prepared_sum(t)`` made (``op`` is SUM: it names the call for the
        watchdog, as ``allreduce(t, t, SUM)`` would)."""
        raise NotImplementedError

    def prepared_buffer(self, t: torch.Tensor) -> Any:
        """What ``broadcast_prepared`` needs to move ``t`` (contiguous, a native dtype), made once and kept by the
        communicator for that buffer; None where the engine has no such shortcut."""
        return None

    def broadcast_prepared(self, t: torch.Tensor, prepared: Any, root: int) -> None:
        """``broadcast`` of ``t`` with what ``prepared_buffer(t)`` made."""
        raise NotImplementedError

    def prepared_blocks(self, send: torch.Tensor, recv: torch.Tensor) -> Any:
        """What ``allgather_prepared``, ``alltoall_prepared`` and ``reduce_scatter_prepared`` need to move ``send``
        and ``recv`` (contiguous, a native dtype, equal blocks per rank), made once and kept by the communicator
        for that pair of buffers; None where the engine has no such shortcut."""
        return None

    def allgather_prepared(self, send: torch.Tensor, recv: torch.Tensor, prepared: Any) -> None:
        """``allgather`` of equal blocks with what ``prepared_blocks(send, recv)`` made."""
        raise NotImplementedError

    def alltoall_prepared(self, send: torch.Tensor, recv: torch.Tensor, prepared: Any) -> None:
        """``alltoall`` of equal blocks with what ``prepared_blocks(send, recv)`` made."""
        raise NotImplementedError

    def reduce_scatter_prepared(self, send: torch.Tensor, recv: torch.Tensor, prepared: Any, op: ReduceOp) -> None:
        """``reduce_scatter`` of equal blocks (SUM) with what ``prepared_blocks(send, recv)`` made."""
        raise NotImplementedError

    def grouped_allreduce(self, xs: Sequence[Any], op: ReduceOp, inplace: bool) -> list[Any] | None:
        """The library's own fused allreduce of many tensors (Horovod's), or None: then the communicator fuses
        them into one flat buffer per dtype itself."""
        return None

    # ------------------------------------------------------------ the desync check's own traffic (comm/check.py)
    def check_exchange(self, *about: object) -> None:
        """MAX allreduce of ``check_buf`` in place. Engines with a communicator to spare move it there, so a
        check can never match a data call of a desynchronised peer. ``about`` (the checked call and its
        arguments) is unused: the watchdog names it when the check waits too long."""
        self.allreduce(self.check_buf, self.check_buf, ReduceOp.MAX)

    def check_exchange_async(self) -> Callable[[], object] | None:
        """Start ``check_exchange`` to overlap it with the call it checks and return its wait; None where the
        check and the data share one channel (then the check must end before the data call starts)."""
        return None

    def check_rows(self, mine: torch.Tensor, table: torch.Tensor) -> Work:
        """Start an allgather of every rank's check row (int64) after a mismatch."""
        self.allgather(mine, table, [mine.numel()] * self.size)
        return DONE

    def pending_mismatch(self) -> Exception | None:
        """An error for a message this rank sent that its receiver refused (mismatched size), if the receiver's
        verdict has arrived; engines whose receiver cannot tell the sender return None (comm/mismatch.py)."""
        return None

    # ------------------------------------------------------------ groups and the job's end
    def sub(self, lists: Sequence[Sequence[int]]) -> list[Engine | None]:
        """One sub-engine per list of this engine's ranks (this rank's, or None where it is not a member), made
        on every rank with the same lists in the same order. Ranks are numbered in list order. One-rank lists
        need no library call (a SoloEngine); the rest are the library's (``_split``)."""
        multi = [list(m) for m in lists if len(m) > 1]
        made = iter(self._split(multi) if multi else [])
        out: list[Engine | None] = []
        for members in lists:
            if len(members) > 1:
                out.append(next(made))
            else:
                out.append(SoloEngine() if self.rank in members else None)
        return out

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        """Sub-engines for ``lists`` (each of 2+ ranks); every rank calls this with the same lists."""
        raise UnidistError(f"{type(self).__name__} has no sub-groups")

    def abort(self, code: int) -> None:  # noqa: B027 - optional: most libraries cannot end other processes
        """End every rank of the job where the library can (``aborts_job``); elsewhere return, and the caller
        exits this process so the launcher stops the others."""

    def close(self) -> None:  # noqa: B027 - optional: most engines hold nothing of their own
        """Free what the engine holds (at shutdown)."""


class SortedOrder:
    """For engines that order a group's members by world rank whatever order they were given in (torch and
    DeepSpeed ``new_group``, Horovod process sets): a group ordered otherwise (``split`` with a key) has its
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


class SoloEngine(Engine):
    """A one-rank communicator on any backend: every collective is a copy, send/recv go through a mailbox."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self._box: dict[int, list[torch.Tensor]] = {}

    def barrier(self) -> None:
        return None

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        return None

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        if send is not recv:
            recv.copy_(send)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        recv.view(-1).copy_(send.view(-1))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                 recv_counts: Sequence[int]) -> None:
        recv.view(-1).copy_(send.view(-1)[: recv_counts[0]])

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._box.setdefault(tag, []).append(t.clone())

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        box = self._box.get(tag)
        if not box:
            raise InvalidArgumentError(f"recv(tag={tag}) on a one-rank communicator with no matching send: it "
                                       "would wait forever")
        msg = box.pop(0)
        if msg.shape != t.shape or msg.dtype != t.dtype:
            raise InvalidArgumentError(f"recv buffer {tuple(t.shape)} {t.dtype} does not match the message "
                                       f"{tuple(msg.shape)} {msg.dtype}")
        t.copy_(msg)

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        raise InvalidArgumentError(f"a one-rank communicator has no group of {len(lists[0])} ranks")

    def close(self) -> None:
        self._box.clear()
