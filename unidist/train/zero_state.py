"""A ZeRO optimizer's state as one process would hold it, and back: ``ZeroOptimizer.full_state_dict`` gathers each
unit's shards of the per-element state into every parameter's whole tensor (keyed by the parameter's index, as a
torch optimizer's ``state_dict``), and ``load_full_state`` cuts such a state into this rank's shards (an optimizer
handed to prepare with state already in it: a resumed Adam)."""

from __future__ import annotations

from typing import Any

import torch

from unidist.train.zero_layout import Sharded

__all__ = ["consolidated", "shard_into"]


def consolidated(zero: Sharded) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` as one process holding every parameter would return it."""
    index = {id(p): i for i, p in enumerate(p for g in zero.full_groups for p in g)}
    state: dict[int, dict[str, Any]] = {}
    for unit in zero.units:
        shard_state = zero.optimizer.state.get(unit.shard, {})
        for key in sorted(shard_state):
            value = shard_state[key]
            if isinstance(value, torch.Tensor) and value.shape == unit.shard.shape:
                flat = torch.empty(unit.chunk * zero.dp.size, dtype=value.dtype, device=unit.device)
                zero.dp.allgather(value.detach().to(unit.device).contiguous(), out=flat)
                offset = 0
                for p, shape, n in zip(unit.params, unit.shapes, unit.numels, strict=True):
                    state.setdefault(index[id(p)], {})[key] = flat[offset:offset + n].view(shape).clone()
                    offset += n
            else:  # per-parameter scalars (Adam's step) are the same for every member of the unit
                for p in unit.params:
                    state.setdefault(index[id(p)], {})[key] = value.clone() if isinstance(
                        value, torch.Tensor) else value
    groups = []
    start = 0
    for g, params in zip(zero.optimizer.param_groups, zero.full_groups, strict=True):
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(params)))})
        start += len(params)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def shard_into(zero: Sharded, full: dict[int, dict[str, Any]]) -> None:
    """Shard a one-process optimizer state (keys: parameter indices) onto this rank's shards."""
    index = {id(p): i for i, p in enumerate(p for g in zero.full_groups for p in g)}
    for unit in zero.units:
        per_param = [full.get(index[id(p)], {}) for p in unit.params]
        keys = set().union(*per_param)
        target: dict[str, Any] = {}
        for key in sorted(keys):
            values = [s.get(key) for s in per_param]
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            if len(tensors) == len(values) and all(t.shape == shape for t, shape in zip(
                    tensors, unit.shapes, strict=True)) and any(len(shape) for shape in unit.shapes):
                flat = torch.zeros(unit.chunk * zero.dp.size, dtype=tensors[0].dtype, device=unit.device)
                torch.cat([t.reshape(-1).to(unit.device) for t in tensors], out=flat[: unit.numel])
                target[key] = flat[unit.lo:unit.lo + unit.chunk].to(unit.shard.device, copy=True)
            else:
                v = next(v for v in values if v is not None)
                target[key] = v.clone() if isinstance(v, torch.Tensor) else v
        if target:
            zero.optimizer.state[unit.shard] = target
