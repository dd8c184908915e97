"""The checkpoint layout of unidist's ZeRO: each rank writes exactly the shards it owns, and reads them back.

The checkpoint format knows only full tensors by name (unidist/checkpoint/layout.py); this maps them to the
units of a ZeroOptimizer. Which part of which parameter a rank owns is the unit's own arithmetic
(``Unit.owned``, in zero_unit.py), so a checkpoint saved at any stage and world size loads at any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from unidist.checkpoint.layout import MASTER, Layout, Pieces, Read, even_slice, fresh_scalars, param_names, per_element
from unidist.comm.protocol import world_ranks

__all__ = ["ShardUnit", "Sharded", "ZeroLayout"]


class ShardUnit(Protocol):
    """What the layout (and zero_state.py) reads of one ZeRO unit (zero_unit.py's ``Unit``): its parameters, their
    full shapes and sizes, which part of each this rank owns, and its shard of the flat buffer."""

    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def shapes(self) -> Sequence[torch.Size]: ...
    @property
    def numels(self) -> Sequence[int]: ...
    @property
    def numel(self) -> int: ...
    @property
    def lo(self) -> int: ...
    @property
    def shard(self) -> torch.Tensor: ...
    @property
    def chunk(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...

    def owned(self, i: int) -> tuple[int, int, int] | None: ...

    def refresh(self) -> None: ...


class Sharded(Protocol):
    """What the layout (and zero_state.py) reads of a ZeroOptimizer (typed here, so neither imports zero.py)."""

    @property
    def dp(self) -> Any: ...
    @property
    def stage(self) -> int: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def units(self) -> Sequence[ShardUnit]: ...
    @property
    def full_groups(self) -> Sequence[Sequence[torch.Tensor]]: ...


class ZeroLayout(Layout):
    """unidist's ZeRO: each rank writes exactly its shards (and an even slice of anything unsharded)."""

    def __init__(self, zero: Sharded) -> None:
        dp = zero.dp
        self.rank, self.size, self.ranks, self.zero_stage = dp.rank, dp.size, world_ranks(dp), zero.stage
        self.zero, self.optimizer = zero, zero.optimizer
        self.module: torch.nn.Module = zero.model
        self.where = {id(p): (u, i) for u in zero.units for i, p in enumerate(u.params)}
        names = param_names(self.module)
        self.shapes = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            hit = self.where.get(id(v))
            shape = tuple(hit[0].shapes[hit[1]]) if hit else tuple(v.shape)  # stage 3 empties the parameter
            self.shapes[k] = (shape, str(v.dtype))
        self.params = [p for g in zero.full_groups for p in g]
        self.opt_names = [names[id(p)] for p in self.params]
        self.opt_groups = [gi for gi, g in enumerate(zero.full_groups) for _ in g]

    def _owned(self, p: torch.Tensor) -> tuple[ShardUnit, int, int, int] | None:
        """(unit, start and end within the parameter, where the start is in the shard) of this rank's part."""
        unit, i = self.where[id(p)]
        own = unit.owned(i)
        return None if own is None else (unit, *own)

    def model_pieces(self, copy: bool = True) -> dict[str, tuple[int, torch.Tensor]]:
        """This rank's part of every state-dict entry: its shard's slice of a sharded parameter, an even slice of
        anything else; copies (a background save writes them while training goes on) or, ``copy=False``, views
        for a reader done before the next step (the training fingerprint)."""
        model: dict[str, tuple[int, torch.Tensor]] = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            if id(v) not in self.where:
                model[k] = even_slice(v, self.rank, self.size, copy=copy)
                continue
            own = self._owned(v)
            if own is None:
                model[k] = (0, torch.empty(0, dtype=v.dtype))
                continue
            unit, s, e, at = own
            part = unit.shard.detach()[at:at + e - s]
            if part.dtype != unit.dtype:  # a master copy: the parameter holds it rounded (zero_unit.py)
                model[k] = (s, part.to(unit.dtype))
            else:
                model[k] = (s, part.clone() if copy else part)
        return model

    def pieces(self, copy: bool = True) -> Pieces:
        model = self.model_pieces(copy)
        optim: dict[str, dict[str, Any]] = {}
        for p, name in zip(self.params, self.opt_names, strict=True) if self.optimizer is not None else ():
            if id(p) not in self.where:  # frozen: whole on every rank, outside the shards (its state, if any, too)
                st = self.optimizer.state.get(p, {})
                optim[name] = {k: even_slice(v, self.rank, self.size, copy) for k, v in st.items()
                               if per_element(v, p.shape)}
                continue
            unit, _ = self.where[id(p)]
            st = dict(self.optimizer.state.get(unit.shard, {}))
            if unit.shard.dtype != unit.dtype:  # the shard is the master copy: saved beside the state
                st[MASTER] = unit.shard
            own = self._owned(p)
            optim[name] = {}
            for key, value in st.items():
                if per_element(value, unit.shard.shape):
                    if own is None:
                        optim[name][key] = (0, value.new_empty(0))
                    else:
                        _, s, e, at = own
                        part = value.detach()[at:at + e - s]
                        optim[name][key] = (s, part.clone() if copy else part)
        return {"model": model, "optim": optim}

    def state_holder(self, p: torch.Tensor) -> torch.Tensor:
        """The unit's shard: the optimizer steps shards, so their state is held under them (a frozen parameter,
        in no unit, holds its own)."""
        hit = self.where.get(id(p))
        return hit[0].shard if hit is not None else p

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        name_of = dict(zip((id(p) for p in self.params), self.opt_names, strict=True))
        with torch.no_grad():
            for k, v in self.module.state_dict(keep_vars=True).items():
                shape, _ = self.shapes[k]
                if id(v) not in self.where:
                    v.copy_(read("model", k, "", 0, int(torch.Size(shape).numel())).view(shape))
                    continue
                own = self._owned(v)
                if own is not None:
                    unit, s, e, at = own
                    name = name_of.get(id(v), "")
                    if unit.shard.dtype != unit.dtype and MASTER in state_keys.get(name, []):
                        unit.shard[at:at + e - s] = read("optim", name, MASTER, s, e)  # the master copy itself
                    else:
                        unit.shard[at:at + e - s] = read("model", k, "", s, e)
            for unit in self.zero.units:
                if self.optimizer is not None:
                    self._load_state(unit, name_of, read, meta, state_keys)
                unit.refresh()  # stages 1-2: every rank's loaded shard into the full parameters
            for p in self.params if self.optimizer is not None else ():
                if id(p) not in self.where:  # frozen: its own state, whole
                    name = name_of[id(p)]
                    entry = {k: read("optim", name, k, 0, p.numel()).view(p.shape) for k in state_keys.get(name, [])}
                    entry.update(fresh_scalars(meta["scalars"].get(name, {})))
                    self.optimizer.state.pop(p, None)
                    if entry:
                        self.optimizer.state[p] = entry
        if self.optimizer is not None:
            self.set_settings(meta["param_groups"])

    def _load_state(self, unit: ShardUnit, name_of: dict[int, str], read: Read, meta: dict[str, Any],
                    state_keys: dict[str, list[str]]) -> None:
        """The unit's shard optimizer state from the per-parameter full state. A parameter saved without state (one
        process never stepped it: it never had a gradient) gets zeros in the shard, what a fresh state holds; the
        unit's scalars (Adam's step) are those of its first parameter that has any."""
        names = [name_of[id(p)] for p in unit.params]
        keys = list(dict.fromkeys(k for n in names for k in state_keys.get(n, []) if k != MASTER))
        target: dict[str, Any] = {}
        for key in keys:
            flat = torch.zeros(unit.chunk, dtype=unit.shard.dtype, device=unit.shard.device)  # offload: the CPU's
            for p, name in zip(unit.params, names, strict=True):
                own = self._owned(p)
                if own is not None and key in state_keys.get(name, []):
                    _, s, e, at = own
                    flat[at:at + e - s] = read("optim", name, key, s, e)
            target[key] = flat
        first = next((n for n in names if meta["scalars"].get(n)), names[0])
        target.update(fresh_scalars(meta["scalars"].get(first, {})))
        self.optimizer.state.pop(unit.shard, None)
        if target:
            self.optimizer.state[unit.shard] = target
