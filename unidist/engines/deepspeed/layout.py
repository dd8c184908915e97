"""A DeepSpeed ZeRO engine's checkpoint layout (``DeepSpeedLayout``): each parameter's full fp32 value and
optimizer state read from the engine's partitions through DeepSpeed's ``safe_get/set_full_*`` calls and, where
those fall short (DeepSpeed 0.19.8), a few of its private methods."""

from __future__ import annotations

from typing import Any

import torch

from unidist.checkpoint.layout import Layout, Pieces, Read, even_slice, fresh_scalars, param_names, per_element

__all__ = ["DeepSpeedLayout"]


class DeepSpeedLayout(Layout):
    """A DeepSpeed ZeRO engine: each parameter's full fp32 value and optimizer state assembled with
    DeepSpeed's safe_get_full_* (a collective, one parameter at a time) and set back with safe_set_full_*."""

    def __init__(self, rank: int, size: int, engine: Any, full_groups: list[list[torch.nn.Parameter]]) -> None:
        self.rank, self.size, self.engine, self.ranks = rank, size, engine, tuple(range(size))
        self.zero_stage = int(engine.zero_optimization_stage())
        self.module: torch.nn.Module = engine.module
        self.zero = engine.optimizer
        self.inner = self.zero.optimizer
        self.optimizer = self.inner
        names = param_names(self.module)
        self.shapes = {k: (tuple(getattr(v, "ds_shape", v.shape)), str(v.dtype))
                       for k, v in self.module.state_dict(keep_vars=True).items()}
        self.params = [p for g in full_groups for p in g]
        self.opt_names = [names[id(p)] for p in self.params]
        self.opt_groups = [gi for gi, g in enumerate(full_groups) for _ in g]
        found: tuple[Any, dict[str, Any]] = next(((q, st) for q, st in self.inner.state.items() if st), (None, {}))
        master, self.flat_state = found
        self.keys = sorted(k for k, v in self.flat_state.items()
                           if master is not None and per_element(v, master.shape))

    def pieces(self) -> Pieces:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        model: dict[str, Any] = {}
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        for k, v in self.module.state_dict(keep_vars=True).items():
            full = safe_get_full_fp32_param(v) if id(v) in by_id else None
            if full is None and hasattr(v, "ds_id"):  # a frozen parameter at stage 3: partitioned, no fp32 master
                full = self._gathered(v)
            model[k] = even_slice(full if full is not None else v, self.rank, self.size)
        optim: dict[str, dict[str, Any]] = {}
        for p, name in zip(self.params, self.opt_names, strict=True) if self.optimizer is not None else ():
            # a frozen parameter is in no partition and has no state (DeepSpeed answers None for it)
            found = {key: safe_get_full_optimizer_state(p, key) for key in self.keys} if p.requires_grad else {}
            optim[name] = {key: even_slice(v, self.rank, self.size) for key, v in found.items() if v is not None}
        return {"model": model, "optim": optim}

    @staticmethod
    def _gathered(p: Any) -> torch.Tensor:
        """A stage-3 parameter's whole value (a collective, as DeepSpeed's GatheredParameters is)."""
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            whole: torch.Tensor = p.detach().clone()
        return whole

    def meta(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"param_groups": [], "scalars": {}}
        scalars = {k: v for k, v in self.flat_state.items() if k not in self.keys}
        return {"param_groups": self.settings(), "scalars": {name: scalars for p, name in
                                                             zip(self.params, self.opt_names, strict=True)
                                                             if p.requires_grad}}

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
        saved: dict[str, Any] = next((meta["scalars"][n] for n in self.opt_names if meta["scalars"].get(n)), {})
        keys = sorted({k for name in self.opt_names for k in state_keys.get(name, [])})
        # A fresh engine has no optimizer state yet (it is made at the first step): make it, zeros, on the
        # fp32 master partitions, and have DeepSpeed link its per-parameter views into it.
        masters = getattr(self.zero, "single_partition_of_fp32_groups", None) or \
            getattr(self.zero, "fp32_partitioned_groups_flat", [])
        for q in masters:
            if not self.inner.state.get(q):
                self.inner.state[q] = {**{k: torch.zeros_like(q) for k in keys}, **fresh_scalars(saved)}
        if hasattr(self.zero, "_lazy_init_hp_params_optimizer_state"):
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()
        for p, name in zip(self.params, self.opt_names, strict=True):
            if not p.requires_grad:  # frozen: in no partition, no state to set
                continue
            for key in state_keys.get(name, []):
                numel: int = getattr(p, "ds_numel", p.numel())  # stage 3 parameters are empty here
                if hasattr(p, "ds_id"):
                    self._set_stage3(p, read("optim", name, key, 0, numel), key)
                else:
                    safe_set_full_optimizer_state(p, read("optim", name, key, 0, p.numel()), key)
        for st in self.inner.state.values():
            for k, v in saved.items():
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v
        self.set_settings(meta["param_groups"])

    def _set_stage3(self, p: Any, value: torch.Tensor, key: str) -> None:
        """This rank's partition of a stage-3 parameter's optimizer state. DeepSpeed 0.19.8's own
        ``set_full_hp_param`` reads past the end of the value when the parameter's size is not a multiple of
        the world size (the last partition is padded), so the padding is added here."""
        part, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        padded = torch.zeros(part.numel() * self.size, dtype=value.dtype)
        padded[: value.numel()] = value.reshape(-1)
        rank = self.zero._get_param_partition_rank(p)
        part.data.copy_(padded[rank * part.numel():(rank + 1) * part.numel()])
