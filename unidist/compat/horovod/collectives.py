"""``horovod.torch``'s collectives with its names, defaults, handles and autograd, over unidist (core.py).

Here: broadcast, alltoall, reducescatter, join and barrier; reductions.py has the allreduce and allgather
families, handles.py ``poll``/``synchronize`` (all re-exported here).

Broadcast roots are world ranks on every process set, as in Horovod. ``alltoall`` returns the output alone
when no splits were given and ``(output, received_splits)`` (int32) when they were; its handle always
synchronizes to the pair. ``reducescatter`` takes Average (default) or Sum, gives the first ``rows % size``
ranks one row more (numpy.array_split), and scales as allreduce does (core.py).

Differences from Horovod: calls must be issued in the same order on every rank (Horovod matches them by name,
in any order; under UNIDIST_CHECK_COLLECTIVES=1 named calls compare their names); ``join`` is a point every
rank must reach (see its docstring); async grouped calls, alltoall and Adasum complete before their handle is
returned; a handle's op starts when the call is made, as Horovod's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from unidist.compat.horovod import core
from unidist.compat.horovod.basics import rank
from unidist.compat.horovod.compression import Compression
from unidist.compat.horovod.core import Adasum, Average, Max, Min, Pending, Product, Sum
from unidist.compat.horovod.handles import poll, register, run, synchronize
from unidist.compat.horovod.process_sets import ProcessSet, comm_of, global_process_set
from unidist.compat.horovod.reductions import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from unidist.compat.horovod.state import manager
from unidist.errors import InvalidArgumentError

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "poll", "reducescatter", "reducescatter_async", "synchronize",
]

_NONE = Compression.none  # Horovod's default
_JOIN_TAG = 32001


# -------------------------------------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.ps = root_rank, ps
        return run(core.broadcast_start, tensor, root_rank, False, ps, name)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s tensor (a world rank) on every member, as a new tensor."""
    if core.grad_mode(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)  # type: ignore[no-any-return,no-untyped-call]
    return run(core.broadcast_start, tensor, root_rank, False, process_set, name)  # type: ignore[no-any-return]


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast; returns ``tensor``."""
    return run(core.broadcast_start, tensor, root_rank, True, process_set, name)  # type: ignore[no-any-return]


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return register(core.broadcast_start, tensor, root_rank, False, process_set, name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    return register(core.broadcast_start, tensor, root_rank, True, process_set, name)


# -------------------------------------------------------------------------------------------- alltoall
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        output, received = run(core.alltoall_start, tensor, splits, ps, name)
        ctx.received, ctx.ps = received, ps
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        back, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.ps)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows (dim 0) to rank i of the set; the output alone without splits, else
    ``(output, received_splits)``."""
    if core.grad_mode(tensor):
        return _Alltoall.apply(tensor, splits, name, process_set)  # type: ignore[no-any-return,no-untyped-call]
    output, received = run(core.alltoall_start, tensor, splits, process_set, name)
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    return register(core.alltoall_start, tensor, splits, process_set, name)


# -------------------------------------------------------------------------------------------- reducescatter
def _scaled_grad(grad: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet) -> torch.Tensor:
    """Horovod's reducescatter backward before its allgather: times size for Sum, times both factors."""
    grad = grad.contiguous()
    if op == Sum:
        grad = grad * comm_of(ps).size
    if pre != 1.0:
        grad = grad * pre
    if post != 1.0:
        grad = grad * post
    return grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, ps: ProcessSet, pre: float,
                post: float) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return run(core.reducescatter_start, tensor, op, pre, post, ps, name)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        return allgather(_scaled_grad(grad, op, pre, post, ps), process_set=ps), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = _NONE, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over the set, then rank i keeps chunk i of dim 0 (the first ``rows % size`` get one more)."""
    compressed, cctx = core.compress(compression, tensor)
    if core.grad_mode(compressed):
        out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)  # type: ignore[no-any-return,no-untyped-call]
    else:
        out = run(core.reducescatter_start, compressed, op, prescale_factor, postscale_factor, process_set, name)
    return core.decompress(compression, out, cctx)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    return register(core.reducescatter_start, tensor, op, prescale_factor, postscale_factor, process_set, name)


def _grouped_reducescatter_start(tensors: Sequence[Any], op: int, pre: float, post: float, ps: ProcessSet,
                                 name: str | None) -> Pending:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise InvalidArgumentError("grouped ops take a non-empty list of tensors")
    parts = [core.reducescatter_start(t, op, pre, post, ps, None) for t in tensors]
    return Pending(None, lambda: [p.wait() for p in parts], name)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, ps: ProcessSet, pre: float, post: float,
                *tensors: torch.Tensor) -> Any:
        ctx.args = (op, pre, post, ps)
        return tuple(run(_grouped_reducescatter_start, list(tensors), op, pre, post, ps, name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        scaled = [_scaled_grad(g, op, pre, post, ps) for g in grads]
        return (None, None, None, None, None, *grouped_allgather(scaled, process_set=ps))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression: Any = _NONE,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    pairs = [core.compress(compression, t) for t in tensors]
    compressed = [p[0] for p in pairs]
    if core.grad_mode(*compressed):
        outs = list(_GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,  # type: ignore[no-any-return,no-untyped-call]
                                                *compressed))
    else:
        outs = run(_grouped_reducescatter_start, compressed, op, prescale_factor, postscale_factor, process_set,
                   name)
    return [core.decompress(compression, o, c) for o, (_, c) in zip(outs, pairs, strict=True)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return register(_grouped_reducescatter_start, tensors, op, prescale_factor, postscale_factor, process_set,
                    name)


# -------------------------------------------------------------------------------------------- join, barrier
def join(device: int = -1) -> int:
    """Wait until every rank has called ``join`` and return the rank that arrived last (same on all ranks).

    Differs from Horovod: Horovod lets ranks that ran out of data join early while the others go on
    allreducing (joined ranks contribute zeros). Here every rank must reach ``join`` before any other
    collective: it is a point-to-point exchange with rank 0 on a tag of its own, so a rank that joined while
    a peer waits in a collective cannot be matched with it; both wait until ``UNIDIST_TIMEOUT`` ends the job
    with a CollectiveTimeoutError instead of reducing the wrong data. ``device`` is accepted and unused.
    """
    mgr = manager()
    if mgr.size == 1:
        return 0
    stamp = torch.tensor([time.time()], dtype=torch.float64)
    answer = torch.zeros(1, dtype=torch.int64)
    if mgr.rank == 0:
        stamps = [float(stamp.item())]
        for peer in range(1, mgr.size):
            buf = torch.empty(1, dtype=torch.float64)
            mgr.recv(buf, peer, _JOIN_TAG)
            stamps.append(float(buf.item()))
        answer[0] = max(range(mgr.size), key=lambda r: (stamps[r], r))
        for peer in range(1, mgr.size):
            mgr.send(answer, peer, _JOIN_TAG)
    else:
        mgr.send(stamp, 0, _JOIN_TAG)
        mgr.recv(answer, 0, _JOIN_TAG)
    return int(answer.item())


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Every member of the set waits here until all have arrived."""
    comm_of(process_set, "Barrier").barrier()
