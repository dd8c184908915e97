"""Horovod's allreduce and allgather families (plain, in place, async, grouped) with their autograd.

ops.py re-exports them beside broadcast, alltoall, reducescatter, join and barrier, whose backward passes
are written on these. Differentiable as Horovod's: allreduce, grouped allreduce, allgather and grouped
allgather, with Horovod's backward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unidist.compat.horovod import core
from unidist.compat.horovod.compression import Compression
from unidist.compat.horovod.core import Average, Pending, resolve_op
from unidist.compat.horovod.handles import claim, register, run
from unidist.compat.horovod.process_sets import ProcessSet, comm_of, global_process_set
from unidist.errors import InvalidArgumentError

__all__ = [
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_",
]

_NONE = Compression.none  # Horovod's default


# -------------------------------------------------------------------------------------------- allreduce
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, name: str | None, pre: float, post: float,
                ps: ProcessSet) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        claim(name)
        return core.allreduce_now(tensor, False, op, pre, post, ps, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        return allreduce(grad.contiguous(), op=op, prescale_factor=pre, postscale_factor=post,
                         process_set=ps), None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = _NONE, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of ``tensor`` over the process set (default op: Average), as a new tensor."""
    rop = resolve_op(op, average)
    compressed, cctx = core.compress(compression, tensor)
    if core.grad_mode(compressed):
        out = _Allreduce.apply(compressed, rop, name, prescale_factor, postscale_factor, process_set)  # type: ignore[no-any-return,no-untyped-call]
    else:
        claim(name)
        out = core.allreduce_now(compressed, False, rop, prescale_factor, postscale_factor, process_set, name)
    return core.decompress(compression, out, cctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns ``tensor``."""
    rop = resolve_op(op, average)
    claim(name)
    return core.allreduce_now(tensor, True, rop, prescale_factor, postscale_factor, process_set, name)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce; ``synchronize(handle)`` returns the result. ``tensor`` is not modified."""
    rop = resolve_op(op, average)
    return register(core.allreduce_start, tensor, False, rop, prescale_factor, postscale_factor, process_set,
                     name)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor``."""
    rop = resolve_op(op, average)
    return register(core.allreduce_start, tensor, True, rop, prescale_factor, postscale_factor, process_set,
                     name)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, name: str | None, pre: float, post: float, ps: ProcessSet,
                *tensors: torch.Tensor) -> Any:
        ctx.args = (op, pre, post, ps)
        return tuple(run(core.grouped_allreduce_start, list(tensors), False, op, pre, post, ps, name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=op, prescale_factor=pre,
                                    postscale_factor=post, process_set=ps)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = _NONE, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce of every tensor of the list, fused per dtype; new tensors."""
    rop = resolve_op(op, average)
    pairs = [core.compress(compression, t) for t in tensors]
    compressed = [p[0] for p in pairs]
    if core.grad_mode(*compressed):
        outs = list(_GroupedAllreduce.apply(rop, name, prescale_factor, postscale_factor, process_set,  # type: ignore[no-any-return,no-untyped-call]
                                            *compressed))
    else:
        outs = run(core.grouped_allreduce_start, compressed, False, rop, prescale_factor, postscale_factor,
                    process_set, name)
    return [core.decompress(compression, o, c) for o, (_, c) in zip(outs, pairs, strict=True)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns the input tensors."""
    rop = resolve_op(op, average)
    return run(core.grouped_allreduce_start, tensors, True, rop,  # type: ignore[no-any-return]
                prescale_factor, postscale_factor, process_set, name)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    rop = resolve_op(op, average)
    return register(core.grouped_allreduce_start, tensors, False, rop, prescale_factor, postscale_factor,
                     process_set, name)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    rop = resolve_op(op, average)
    return register(core.grouped_allreduce_start, tensors, True, rop, prescale_factor, postscale_factor,
                     process_set, name)


# -------------------------------------------------------------------------------------------- allgather
def _my_rows(grad: torch.Tensor, rows: int, ps: ProcessSet) -> torch.Tensor:
    """This rank's slice of an allgather's gradient: offsets from every rank's row count."""
    counts = allgather(torch.tensor([rows], dtype=torch.int32), process_set=ps).tolist()
    r = comm_of(ps).rank
    return grad.narrow(0, int(sum(counts[:r])), rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.ps = tensor.shape[0] if tensor.dim() else 0, ps
        return run(core.allgather_start, tensor, ps, name)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        return _my_rows(reduced, ctx.rows, ctx.ps), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (first dims may differ)."""
    if core.grad_mode(tensor):
        return _Allgather.apply(tensor, name, process_set)  # type: ignore[no-any-return,no-untyped-call]
    return run(core.allgather_start, tensor, process_set, name)  # type: ignore[no-any-return]


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return register(core.allgather_start, tensor, process_set, name)


def _grouped_allgather_start(tensors: Sequence[Any], ps: ProcessSet, name: str | None) -> Pending:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise InvalidArgumentError("grouped ops take a non-empty list of tensors")
    parts = [core.allgather_start(t, ps, None) for t in tensors]
    return Pending(None, lambda: [p.wait() for p in parts], name)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, ps: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.rows, ctx.ps = [t.shape[0] if t.dim() else 0 for t in tensors], ps
        return tuple(run(_grouped_allgather_start, list(tensors), ps, name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.ps)
        return (None, None, *[_my_rows(g, n, ctx.ps) for g, n in zip(reduced, ctx.rows, strict=True)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    if core.grad_mode(*tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))  # type: ignore[no-any-return,no-untyped-call]
    return run(_grouped_allgather_start, tensors, process_set, name)  # type: ignore[no-any-return]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    return register(_grouped_allgather_start, tensors, process_set, name)
