"""Rank 0's parameters and optimizer state everywhere: what every run does once before training.

Written on any communicator (the world or a Group), so data-parallel groups each start from their own root.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from unidist.comm.protocol import Comm

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]

_TENSOR = "__tensor__"


def broadcast_parameters(comm: Comm, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]
                         | Iterable[tuple[str, torch.Tensor]], root: int = 0) -> None:
    """Root's parameters and buffers, in place, everywhere: one fused broadcast per dtype and device."""
    if isinstance(model_or_state, torch.nn.Module):
        tensors = list(model_or_state.state_dict().values())
    elif isinstance(model_or_state, Mapping):
        tensors = list(model_or_state.values())
    else:
        tensors = [t for _, t in model_or_state]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            comm.broadcast_(flat, root)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_optimizer_state(comm: Comm, optimizer: Any, root: int = 0) -> None:
    """Root's optimizer state (tensors and Python scalars such as Adam's step) loaded everywhere.

    The state's layout (its tensors' dtypes and shapes, and every non-tensor value) travels pickled; the
    tensors travel by broadcast and land on this rank's device, not the root's."""
    inner = getattr(optimizer, "optimizer", optimizer)
    state = inner.state_dict() if comm.rank == root else None
    tensors: list[torch.Tensor] = []

    def strip(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return (_TENSOR, len(tensors) - 1, obj.dtype, tuple(obj.shape), obj.device.type)
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj
    skeleton = comm.broadcast_object(strip(state) if state is not None else None, root)
    if comm.rank != root:
        def alloc(obj: Any) -> Any:
            if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == _TENSOR:
                device = comm.device if obj[4] == "cuda" else torch.device("cpu")  # cuda:0 on root is cuda:k here
                t = torch.empty(obj[3], dtype=obj[2], device=device)
                tensors.append(t)
                return t
            if isinstance(obj, dict):
                return {k: alloc(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(alloc(v) for v in obj)
            return obj
        state = alloc(skeleton)
    for t in tensors:
        comm.broadcast_(t, root)
    if comm.rank != root:
        inner.load_state_dict(state)
