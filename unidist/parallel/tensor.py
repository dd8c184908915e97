"""Megatron-style tensor parallelism over any unidist communicator (the world or a Group), on every backend.

A ``ColumnParallelLinear`` keeps 1/p of the output features on each of the p ranks of its group, a
``RowParallelLinear`` 1/p of the input features. Column then Row computes what the dense pair computes:

    Column:  x --f--> x W_i^T + b_i  (--gather--> the full output, if ``gather_output``)
    Row:     x_i --> x_i V_i^T --g--> sum over ranks, + b (added once, after the sum)

``f`` is the identity forward and an allreduce of the input gradient backward; ``g`` is its conjugate, an
allreduce forward and the identity backward. Every rank of the group runs the same layers in the same order
(they are collectives); the batch and anything replicated must be equal across the group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from unidist.comm.protocol import Comm
from unidist.errors import InvalidArgumentError

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "copy_to_group", "gather_from_group", "reduce_from_group",
           "scatter_to_group"]


# ----------------------------------------------------------------------------- the four conjugate functions
class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Comm) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.allreduce(grad.contiguous()), None  # type: ignore[no-any-return]


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Comm) -> torch.Tensor:
        return group.allreduce(x.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _gather_last(x: torch.Tensor, group: Comm) -> torch.Tensor:
    """Every rank's x concatenated along the last dim, in group rank order."""
    moved = x.movedim(-1, 0).contiguous()
    out = torch.empty((moved.shape[0] * group.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    group.allgather(moved, out=out)
    return out.movedim(0, -1)


def _my_part(x: torch.Tensor, group: Comm) -> torch.Tensor:
    width = x.shape[-1] // group.size
    return x[..., group.rank * width:(group.rank + 1) * width].contiguous()


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Comm) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _my_part(grad, ctx.group), None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Comm) -> torch.Tensor:
        ctx.group = group
        return _my_part(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad.contiguous(), ctx.group), None


def copy_to_group(x: torch.Tensor, group: Comm) -> torch.Tensor:
    """Identity forward; backward sums the input gradient over ``group`` (Megatron's f)."""
    return _CopyToGroup.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


def reduce_from_group(x: torch.Tensor, group: Comm) -> torch.Tensor:
    """Sum over ``group`` forward; identity backward (Megatron's g)."""
    return _ReduceFromGroup.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


def gather_from_group(x: torch.Tensor, group: Comm) -> torch.Tensor:
    """Concatenate the ranks' last dims forward; keep this rank's part of the gradient backward."""
    return _GatherFromGroup.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


def scatter_to_group(x: torch.Tensor, group: Comm) -> torch.Tensor:
    """Keep this rank's part of the last dim forward; gather the gradient backward."""
    return _ScatterToGroup.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


# ----------------------------------------------------------------------------- the layers
def _shard(features: int, group: Comm, what: str) -> int:
    if not hasattr(group, "allgather") or not hasattr(group, "size"):
        raise InvalidArgumentError(f"{what}: group must be a unidist Manager or Group, got {type(group).__name__}")
    if features <= 0 or features % group.size:
        raise InvalidArgumentError(
            f"{what}: {features} features do not split evenly over the group's {group.size} ranks; choose a "
            f"multiple of {group.size} (uneven shards would make the ranks' matrices differ in shape)")
    return int(features // group.size)


def _linear_parameters(shape: tuple[int, int], bias: int | None, fan_in: int, device: Any, dtype: Any
                       ) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """A shard's weight (and bias of ``bias`` elements) drawn within nn.Linear's bounds for the dense layer's
    ``fan_in``; each rank draws its own part."""
    bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
    weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound))
    if bias is None:
        return weight, None
    return weight, torch.nn.Parameter(torch.empty(bias, device=device, dtype=dtype).uniform_(-bound, bound))


class ColumnParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with W's rows (output features) split over ``group``.

    Args:
        in_features: as ``torch.nn.Linear``.
        out_features: as ``torch.nn.Linear``; must divide by group.size.
        group: a Manager or Group; every member builds this layer.
        bias: a bias for this rank's output features.
        gather_output: return the full output on every rank (else this rank's 1/p of the features, the input
            a ``RowParallelLinear(input_is_parallel=True)`` wants).
        device: of the parameters.
        dtype: of the parameters.
    """

    def __init__(self, in_features: int, out_features: int, group: Comm, bias: bool = True, *,
                 gather_output: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _shard(out_features, group, "ColumnParallelLinear(out_features)")
        self.weight, self.bias = _linear_parameters((self.local_out, in_features), self.local_out if bias else None,
                                                    in_features, device, dtype)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, group: Comm, *, gather_output: bool = True) -> ColumnParallelLinear:
        """This rank's rows of ``linear`` (every rank passes the same dense layer)."""
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    gather_output=gather_output, device=linear.weight.device, dtype=linear.weight.dtype)
        rows = slice(group.rank * layer.local_out, (group.rank + 1) * layer.local_out)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])
            if layer.bias is not None and linear.bias is not None:
                layer.bias.copy_(linear.bias[rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather_from_group(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.local_out} here), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with W's columns (input features) split over ``group``; the partial products are
    summed over the group and the bias, held whole on every rank, is added once after the sum.

    Args:
        in_features: as ``torch.nn.Linear``; must divide by group.size.
        out_features: as ``torch.nn.Linear``.
        group: a Manager or Group; every member builds this layer.
        bias: a bias (replicated; its gradient is the same on every rank).
        input_is_parallel: the input is already this rank's 1/p of the features (a ColumnParallelLinear with
            ``gather_output=False`` before it); else the full input is split here.
        device: of the parameters.
        dtype: of the parameters.
    """

    def __init__(self, in_features: int, out_features: int, group: Comm, bias: bool = True, *,
                 input_is_parallel: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _shard(in_features, group, "RowParallelLinear(in_features)")
        self.weight, self.bias = _linear_parameters((out_features, self.local_in), out_features if bias else None,
                                                    in_features, device, dtype)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, group: Comm, *, input_is_parallel: bool = False
                   ) -> RowParallelLinear:
        """This rank's columns of ``linear``, and its whole bias (every rank passes the same dense layer)."""
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                    input_is_parallel=input_is_parallel, device=linear.weight.device, dtype=linear.weight.dtype)
        cols = slice(group.rank * layer.local_in, (group.rank + 1) * layer.local_in)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, cols])
            if layer.bias is not None and linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                raise InvalidArgumentError(f"RowParallelLinear: input has {x.shape[-1]} features, the layer "
                                           f"{self.in_features}")
            x = scatter_to_group(x, self.group)
        elif x.shape[-1] != self.local_in:
            raise InvalidArgumentError(f"RowParallelLinear(input_is_parallel=True): input has {x.shape[-1]} "
                                       f"features, this rank's part is {self.local_in}")
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.local_in} here), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")
