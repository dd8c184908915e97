"""How a reduction reaches an engine: the op and dtype mapped to what engines reduce natively.

MEAN is a SUM then one division (engines have no mean); bool is reduced as 0/1 bytes (max is or, min is and);
dtypes an engine cannot reduce (MPI's 16-bit floats, gloo's int16) are reduced in a wider dtype and copied back.
Written once here for every communicator and every reducing call (allreduce, reduce_scatter, grouped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from unidist.comm.dtypes import BOOL_OP
from unidist.comm.work import DONE, Work
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp

__all__ = ["reduce_with"]


def reduce_with(prim: Callable[..., Work | None], send: torch.Tensor, recv: torch.Tensor, op: ReduceOp, size: int,
                upcast: Mapping[torch.dtype, torch.dtype], *extra: Any) -> tuple[Work, Callable[[], None] | None]:
    """Call ``prim(send, recv, *extra, op)`` with op and dtype mapped to what the engine reduces natively; returns
    the work and what to run once it is done (the mean's division, the narrowing copy back), or None.

    Args:
        prim: the engine primitive (blocking or async).
        send: the input buffer.
        recv: the output buffer (``send`` itself for in place).
        op: any ReduceOp; MEAN is a SUM then a division by ``size``.
        size: the ranks reduced over.
        upcast: the engine's ``upcast_reduce`` (dtypes it reduces in a wider one).
        extra: the primitive's arguments between the buffers and the op (reduce_scatter's counts).
    """
    dtype = send.dtype
    mean = op is ReduceOp.MEAN
    if mean:
        if not dtype.is_floating_point:
            raise InvalidArgumentError(
                f"op='mean' needs a floating-point tensor, got {dtype}; use op='sum' and divide, or cast first"
            )
        op = ReduceOp.SUM
    if dtype is torch.bool:  # reduce 0/1 bytes: max is or, min is and
        in_place = send is recv
        send = send.view(torch.uint8)
        recv = send if in_place else recv.view(torch.uint8)
        op, dtype = BOOL_OP[op], torch.uint8
    wide_dtype = upcast.get(dtype)
    if wide_dtype is not None:
        wide = send.to(wide_dtype)
        wide_out = wide if send is recv else torch.empty(recv.shape, dtype=wide_dtype, device=recv.device)
        work = prim(wide, wide_out, *extra, op)

        def narrow() -> None:
            if mean and size > 1:
                wide_out.div_(size)
            recv.copy_(wide_out)
        return work or DONE, narrow
    work = prim(send, recv, *extra, op)
    if mean and size > 1:
        def divide() -> None:
            recv.div_(size)
        return work or DONE, divide
    return work or DONE, None
