"""BatchNorm over the whole batch across ranks, on every backend and device: ``prepare(..., sync_batchnorm=True)``.

With plain BatchNorm each rank normalises by the statistics of its own B/N rows, so N ranks do not train like one
process on B rows, and small per-rank batches make the statistics noisy. torch's ``nn.SyncBatchNorm`` fixes that
for GPUs on torch.distributed only; this one is written on unidist's collectives, so it runs wherever ``prepare``
does (CPU and GPU; mpi, torch, deepspeed, horovod, groups):

- forward (training, or any mode without running statistics): each rank's per-channel mean and biased variance and
  row count travel in one allgather; they are combined exactly (Chan et al.'s parallel variance, in float64), so
  every rank normalises by the whole batch's mean and variance, and updates the running statistics as one
  process would (the unbiased variance of the whole batch, ``momentum`` or the cumulative average);
- backward: the per-channel sums of the output gradient and of its product with the normalised input travel in
  one allreduce: the input gradient is then the whole batch's (as torch's SyncBatchNorm computes it), and the
  weight and bias gradients stay each rank's own part, which the optimizer's average completes;
- eval with running statistics: plain ``F.batch_norm``, no communication.

The statistics are computed in float32 from inputs of any dtype, and the output has the input's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from unidist.comm.protocol import Comm
from unidist.errors import InvalidArgumentError

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class _CommRef:
    """Holds the communicator inside a module without copying or pickling it: ``copy.deepcopy(model)`` (an EMA copy)
    shares it, and a pickled model carries none (its BatchNorm then runs unsynchronised, as on one rank)."""

    def __init__(self, comm: Comm | None) -> None:
        self.comm = comm

    def __deepcopy__(self, memo: dict[int, Any]) -> _CommRef:
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {"comm": None}


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm1d/2d/3d`` whose training statistics are the whole batch's across ``comm``'s ranks.

    Made by :func:`convert_sync_batchnorm` from an existing BatchNorm: the same parameters and buffers (the same
    tensor objects, so an optimizer built before keeps working) and the same ``state_dict`` keys.
    """

    def __init__(self, num_features: int, comm: Comm | None = None, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._comm = _CommRef(comm)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise InvalidArgumentError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        comm = self._comm.comm
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        whole_batch = self.training or not self.track_running_stats
        if not whole_batch or comm is None or comm.size == 1:
            return F.batch_norm(input, self.running_mean if not self.training or self.track_running_stats else None,
                                self.running_var if not self.training or self.track_running_stats else None,
                                self.weight, self.bias, whole_batch, factor, self.eps)
        running = self.track_running_stats and self.training
        out: torch.Tensor = _SyncBN.apply(  # type: ignore[no-untyped-call]
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, factor, comm)
        return out


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float, momentum: float,
                comm: Comm) -> torch.Tensor:
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        n = x.numel() // c if c else 0
        if n:
            var, mean = torch.var_mean(xf, dim=dims, correction=0)
        else:
            var = mean = xf.new_zeros(c)
        mine = torch.cat([mean.double(), var.double(), mean.new_full((1,), n, dtype=torch.float64)])
        every = comm.allgather(mine.reshape(1, -1))  # (ranks, 2C+1)
        counts, means, variances = every[:, -1:], every[:, :c], every[:, c:2 * c]
        total = float(counts.sum())
        if total < 2 and running_var is not None:
            raise InvalidArgumentError(f"SyncBatchNorm needs more than one value per channel across all ranks to "
                                       f"update its running variance, got {int(total)} in all")
        g_mean = (counts * means).sum(0) / total
        g_var = (counts * (variances + (means - g_mean) ** 2)).sum(0) / total
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
                unbiased = g_var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        mean32, invstd = g_mean.float().view(shape), (g_var + eps).rsqrt().float().view(shape)
        xhat = (xf - mean32) * invstd
        out = xhat
        if weight is not None:
            out = out * weight.float().view(shape)
        if bias is not None:
            out = out + bias.float().view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.comm, ctx.total, ctx.dims, ctx.shape, ctx.has_bias = comm, total, dims, shape, bias is not None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        g = grad_out.float()
        sum_g = g.sum(ctx.dims)
        sum_gx = (g * xhat).sum(ctx.dims)
        c = sum_g.numel()
        both = ctx.comm.allreduce(torch.cat([sum_g, sum_gx]).double(), "sum")
        mean_g = (both[:c] / ctx.total).float().view(ctx.shape)
        mean_gx = (both[c:] / ctx.total).float().view(ctx.shape)
        scale = invstd if weight is None else invstd * weight.float().view(ctx.shape)
        grad_x = (scale * (g - mean_g - xhat * mean_gx)).to(grad_out.dtype)
        grad_w = sum_gx.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_g.to(weight.dtype if weight is not None else g.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


_PLAIN = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def convert_sync_batchnorm(module: torch.nn.Module, comm: Comm) -> torch.nn.Module:
    """Every ``BatchNorm1d/2d/3d`` (and torch ``SyncBatchNorm``) in ``module`` replaced, in place, by a
    :class:`SyncBatchNorm` over ``comm`` holding the same parameter and buffer tensors; returns ``module`` (or the
    replacement, when ``module`` itself is a BatchNorm).

    Args:
        module: the user's model.
        comm: the data-parallel ranks whose rows make the batch (the world or a Group).
    """
    if isinstance(module, _PLAIN) and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(module.num_features, comm, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
        new.training = module.training
        with torch.no_grad():
            for name in ("weight", "bias"):
                setattr(new, name, getattr(module, name))  # the same Parameter objects (the optimizer holds them)
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                new.register_buffer(name, getattr(module, name))
        return new
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, comm)
        if converted is not child:
            module.add_module(name, converted)
    return module
