"""What one rank holds of the full training state, and how it writes and reads its part.

The checkpoint speaks only of *full* tensors by name: the model's state-dict entries and, per parameter name,
the optimizer's per-element state (Adam's ``exp_avg``...) and scalars (``step``), plus the param groups'
settings. A Layout maps that to a backend's reality: whole tensors on every rank (stage 0, each rank writes
an even 1/N slice of every tensor), unidist's ZeRO shards (each rank writes exactly what it owns), or a
DeepSpeed engine's partitions (assembled per parameter with DeepSpeed's own safe_get/set calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeepSpeedLayout", "FullLayout", "Layout", "ZeroLayout", "even"]

Pieces = dict[str, Any]  # {"model": {name: (start, flat)}, "optim": {pname: {key: (start, flat)}}}
Read = Callable[[str, str, str, int, int], torch.Tensor]  # (kind, name, key, start, end) -> flat slice


def even(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's slice [start, end) of n elements split into near-equal parts."""
    chunk = -(-n // size) if n else 0
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


def _slice(t: torch.Tensor, rank: int, size: int) -> tuple[int, torch.Tensor]:
    flat = t.detach().reshape(-1)
    s, e = even(flat.numel(), rank, size)
    return s, flat[s:e].clone()


class Layout:
    """Base: the full state's description (names, shapes, dtypes) is common to every backend."""

    rank: int
    size: int
    shapes: dict[str, tuple[tuple[int, ...], str]]  # model state-dict name -> (shape, dtype)
    optimizer: Any = None  # the torch optimizer whose class and param groups are saved
    opt_names: list[str]  # optimizer parameters by name, in the optimizer's order
    opt_groups: list[int]  # each one's param-group index

    def describe(self) -> dict[str, Any]:
        """The manifest's description of the state (compared on load before anything changes)."""
        out: dict[str, Any] = {"model": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.shapes.items()}}
        if self.optimizer is not None:
            out["optimizer"] = {"class": type(self.optimizer).__name__, "params": self.opt_names,
                                "groups": self.opt_groups}
        return out

    def pieces(self) -> Pieces:
        raise NotImplementedError

    def meta(self) -> dict[str, Any]:
        """Non-element optimizer data: param-group settings and per-parameter scalars (rank-identical)."""
        raise NotImplementedError

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        raise NotImplementedError

    def _settings(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _set_settings(self, groups: list[dict[str, Any]]) -> None:
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(saved)


def _names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def _scalars(saved: dict[str, Any]) -> dict[str, Any]:
    """Fresh copies: parameters saved from one ZeRO unit share their step tensor, and optimizers increment
    step tensors in place, once per parameter."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}


def _per_element(value: Any, shape: torch.Size | tuple[int, ...]) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(shape)


class FullLayout(Layout):
    """Every rank holds every tensor (stage 0 on any backend): each writes an even slice of each."""

    def __init__(self, rank: int, size: int, module: torch.nn.Module, optimizer: Any) -> None:
        self.rank, self.size, self.module, self.optimizer = rank, size, module, optimizer
        self.shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in module.state_dict().items()}
        names = _names(module)
        params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.params = params
        self.opt_names = [names[id(p)] for p in params]
        self.opt_groups = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]] \
            if optimizer is not None else []

    def pieces(self) -> Pieces:
        model = {k: _slice(v, self.rank, self.size) for k, v in self.module.state_dict().items()}
        optim: dict[str, dict[str, Any]] = {}
        for p, name in zip(self.params, self.opt_names, strict=True) if self.optimizer is not None else ():
            st = self.optimizer.state.get(p, {})
            optim[name] = {k: _slice(v, self.rank, self.size) for k, v in st.items() if _per_element(v, p.shape)}
        return {"model": model, "optim": optim}

    def meta(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"param_groups": [], "scalars": {}}
        scalars = {}
        for p, name in zip(self.params, self.opt_names, strict=True):
            st = self.optimizer.state.get(p, {})
            scalars[name] = {k: v for k, v in st.items() if not _per_element(v, p.shape)}
        return {"param_groups": self._settings(), "scalars": scalars}

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        full = {}
        for k, (shape, _) in self.shapes.items():
            n = int(torch.Size(shape).numel())
            full[k] = read("model", k, "", 0, n).view(shape)
        self.module.load_state_dict(full, strict=True)
        if self.optimizer is None:
            return
        state: dict[int, dict[str, Any]] = {}
        for i, (p, name) in enumerate(zip(self.params, self.opt_names, strict=True)):
            entry = {k: read("optim", name, k, 0, p.numel()).view(p.shape) for k in state_keys.get(name, [])}
            entry.update(_scalars(meta["scalars"].get(name, {})))
            if entry:
                state[i] = entry
        groups, start = [], 0
        for g, saved in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            groups.append({**saved, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


class ZeroLayout(Layout):
    """unidist's ZeRO: each rank writes exactly its shards (and an even slice of anything unsharded)."""

    def __init__(self, zero: Any) -> None:
        dp = zero.dp
        self.rank, self.size, self.zero, self.optimizer = dp.rank, dp.size, zero, zero.optimizer
        self.module: torch.nn.Module = zero.model
        self.where = {id(p): (u, i) for u in zero.units for i, p in enumerate(u.params)}
        names = _names(self.module)
        self.shapes = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            hit = self.where.get(id(v))
            shape = tuple(hit[0].shapes[hit[1]]) if hit else tuple(v.shape)
            self.shapes[k] = (shape, str(v.dtype))
        self.params = [p for g in zero.full_groups for p in g]
        self.opt_names = [names[id(p)] for p in self.params]
        self.opt_groups = [gi for gi, g in enumerate(zero.full_groups) for _ in g]

    def _owned(self, p: torch.Tensor) -> tuple[Any, int, int, int] | None:
        """(unit, start and end within the parameter, offset of the parameter in the unit) of this rank's part."""
        unit, i = self.where[id(p)]
        off = sum(unit.numels[:i])
        s, e = max(off, unit.lo), min(off + unit.numels[i], unit.lo + unit.chunk)
        return (unit, s - off, e - off, off) if s < e else None

    def pieces(self) -> Pieces:
        model: dict[str, Any] = {}
        optim: dict[str, dict[str, Any]] = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            if id(v) not in self.where:
                model[k] = _slice(v, self.rank, self.size)
                continue
            own = self._owned(v)
            if own is None:
                model[k] = (0, torch.empty(0, dtype=v.dtype))
                continue
            unit, s, e, off = own
            model[k] = (s, unit.shard.detach()[off + s - unit.lo: off + e - unit.lo].clone())
        for p, name in zip(self.params, self.opt_names, strict=True) if self.optimizer is not None else ():
            unit, _ = self.where[id(p)]
            st = self.optimizer.state.get(unit.shard, {})
            own = self._owned(p)
            optim[name] = {}
            for key, value in st.items():
                if _per_element(value, unit.shard.shape):
                    if own is None:
                        optim[name][key] = (0, value.new_empty(0))
                    else:
                        _, s, e, off = own
                        optim[name][key] = (s, value.detach()[off + s - unit.lo: off + e - unit.lo].clone())
        return {"model": model, "optim": optim}

    def meta(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"param_groups": [], "scalars": {}}
        scalars = {}
        for p, name in zip(self.params, self.opt_names, strict=True):
            st = self.optimizer.state.get(self.where[id(p)][0].shard, {})
            scalars[name] = {k: v for k, v in st.items() if not _per_element(v, self.where[id(p)][0].shard.shape)}
        return {"param_groups": self._settings(), "scalars": scalars}

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
                    unit, s, e, off = own
                    unit.shard[off + s - unit.lo: off + e - unit.lo] = read("model", k, "", s, e)
            for unit in self.zero.units:
                if self.optimizer is None:
                    unit.refresh()
                    continue
                target: dict[str, Any] = {}
                keys = state_keys.get(name_of[id(unit.params[0])], [])
                for key in keys:
                    flat = torch.zeros(unit.chunk, dtype=unit.dtype, device=unit.device)
                    for p in unit.params:
                        own = self._owned(p)
                        if own is not None:
                            _, s, e, off = own
                            flat[off + s - unit.lo: off + e - unit.lo] = read("optim", name_of[id(p)], key, s, e)
                    target[key] = flat
                target.update(_scalars(meta["scalars"].get(name_of[id(unit.params[0])], {})))
                self.optimizer.state.pop(unit.shard, None)
                if target:
                    self.optimizer.state[unit.shard] = target
                unit.refresh()  # stages 1-2: every rank's loaded shard into the full parameters
        if self.optimizer is not None:
            self._set_settings(meta["param_groups"])


class DeepSpeedLayout(Layout):
    """A DeepSpeed ZeRO engine: each parameter's full fp32 value and optimizer state assembled with
    DeepSpeed's safe_get_full_* (a collective, one parameter at a time) and set back with safe_set_full_*."""

    def __init__(self, rank: int, size: int, engine: Any, full_groups: list[list[torch.nn.Parameter]]) -> None:
        self.rank, self.size, self.engine = rank, size, engine
        self.module: torch.nn.Module = engine.module
        self.zero = engine.optimizer
        self.inner = self.zero.optimizer
        self.optimizer = self.inner
        names = _names(self.module)
        self.shapes = {k: (tuple(getattr(v, "ds_shape", v.shape)), str(v.dtype))
                       for k, v in self.module.state_dict(keep_vars=True).items()}
        self.params = [p for g in full_groups for p in g]
        self.opt_names = [names[id(p)] for p in self.params]
        self.opt_groups = [gi for gi, g in enumerate(full_groups) for _ in g]
        found: tuple[Any, dict[str, Any]] = next(((q, st) for q, st in self.inner.state.items() if st), (None, {}))
        master, self.flat_state = found
        self.keys = sorted(k for k, v in self.flat_state.items()
                           if master is not None and _per_element(v, master.shape))

    def pieces(self) -> Pieces:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        model: dict[str, Any] = {}
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        for k, v in self.module.state_dict(keep_vars=True).items():
            full = safe_get_full_fp32_param(v) if id(v) in by_id else None
            model[k] = _slice(full if full is not None else v, self.rank, self.size)
        optim = {name: {key: _slice(safe_get_full_optimizer_state(p, key), self.rank, self.size)
                        for key in self.keys} for p, name in zip(self.params, self.opt_names, strict=True)
                 } if self.optimizer is not None else {}
        return {"model": model, "optim": optim}

    def meta(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"param_groups": [], "scalars": {}}
        scalars = {k: v for k, v in self.flat_state.items() if k not in self.keys}
        return {"param_groups": self._settings(), "scalars": {name: scalars for name in self.opt_names}}

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_optimizer_state

        full = {k: read("model", k, "", 0, int(torch.Size(s).numel())).view(s) for k, (s, _) in self.shapes.items()}
        entries = self.module.state_dict(keep_vars=True)
        params = [v for v in entries.values() if isinstance(v, torch.nn.Parameter)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for k, v in entries.items():
                v.data.copy_(full[k].to(v.dtype))
        self.zero.refresh_fp32_params()  # the fp32 master partitions from the loaded parameters
        if self.optimizer is None:
            return
        saved = meta["scalars"].get(self.opt_names[0], {}) if self.opt_names else {}
        keys = sorted({k for name in self.opt_names for k in state_keys.get(name, [])})
        # A fresh engine has no optimizer state yet (it is made at the first step): make it, zeros, on the
        # fp32 master partitions, and have DeepSpeed link its per-parameter views into it.
        masters = getattr(self.zero, "single_partition_of_fp32_groups", None) or \
            getattr(self.zero, "fp32_partitioned_groups_flat", [])
        for q in masters:
            if not self.inner.state.get(q):
                self.inner.state[q] = {**{k: torch.zeros_like(q) for k in keys}, **_scalars(saved)}
        if hasattr(self.zero, "_lazy_init_hp_params_optimizer_state"):
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()
        for p, name in zip(self.params, self.opt_names, strict=True):
            for key in state_keys.get(name, []):
                numel: int = getattr(p, "ds_numel", p.numel())  # stage 3 parameters are empty here
                if hasattr(p, "ds_id"):
                    self._set_stage3(p, read("optim", name, key, 0, numel), key)
                else:
                    safe_set_full_optimizer_state(p, read("optim", name, key, 0, p.numel()), key)
        for st in self.inner.state.values():
            for k, v in saved.items():
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v
        self._set_settings(meta["param_groups"])

    def _set_stage3(self, p: Any, value: torch.Tensor, key: str) -> None:
        """This rank's partition of a stage-3 parameter's optimizer state. DeepSpeed 0.19.8's own
        ``set_full_hp_param`` reads past the end of the value when the parameter's size is not a multiple of
        the world size (the last partition is padded), so the padding is added here."""
        part, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        padded = torch.zeros(part.numel() * self.size, dtype=value.dtype)
        padded[: value.numel()] = value.reshape(-1)
        rank = self.zero._get_param_partition_rank(p)
        part.data.copy_(padded[rank * part.numel():(rank + 1) * part.numel()])

