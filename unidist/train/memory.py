"""What a rank holds for the prepared model: parameter, gradient and optimizer-state bytes, and the peak.

Tensors are counted by storage, once each: parameters that are views into a flat buffer (ZeRO units,
DeepSpeed's flat groups) count the buffer once, and communication buffers that hold gradients (fusion
buckets) count as gradient bytes, since they are what the rank keeps between steps.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["MemoryStats", "optimizer_tensors", "peak_bytes", "storage_bytes"]

MemoryStats = dict[str, int]


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and non-tensors skipped)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's ``state``."""
    out: list[torch.Tensor] = []
    for per_param in getattr(optimizer, "state", {}).values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def peak_bytes(device: torch.device) -> int:
    """The process's peak: CUDA's peak allocation on a GPU; on CPU the peak resident set (which also counts
    the interpreter and libraries, ~0.3-0.5 GB with torch)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
