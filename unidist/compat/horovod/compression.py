"""``hvd.Compression``: what travels on the wire for an allreduce, as Horovod defines it.

A compressor is a class with static ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``;
scripts pass the class itself (``compression=hvd.Compression.fp16``) and may define their own. ``fp16`` casts
floating-point tensors to float16 before the reduction and back to their dtype after it, so the sum is taken in
float16 exactly as in Horovod (an overflow there is an overflow here); other dtypes pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Interface: compress a tensor and return it with what ``decompress`` needs to restore it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The default: the tensor itself (an in-place reduction then writes into it)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel (and are summed) as float16; ``ctx`` is their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if isinstance(ctx, torch.dtype) and ctx.is_floating_point:
            return tensor.to(ctx)
        return tensor


class Compression:
    """Gradient compression for ``allreduce`` and ``DistributedOptimizer``: ``none`` (default) or ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
