"""A DeepSpeed ZeRO engine's checkpoint layout (``DeepSpeedLayout``): each parameter's full fp32 value and
optimizer state read from the engine's partitions through DeepSpeed's ``safe_get/set_full_*`` calls and, where
those fall short (DeepSpeed 0.19.8), a few of its private methods.

A half-precision model (the bf16 section, ``precision="bf16-master"``) keeps float32 master copies in the engine's
optimizer: the model entry is the weight as the model holds it (rounded) and the copy is saved beside the optimizer
state under ``MASTER``, as unidist's own optimizers save theirs, so a checkpoint resumes the copies on any backend.
At stage 0 DeepSpeed's wrapper for such a model (``FP16_Optimizer``) has no ``safe_get`` support: its flat float32
groups are read directly (``_flat_views``)."""

from __future__ import annotations

from typing import Any

import torch

from unidist.checkpoint.layout import MASTER, Layout, Pieces, Read, even_slice, fresh_scalars, param_names, per_element

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
        self.flat = self._flat_views()

    @property
    def flat_state(self) -> dict[str, Any]:
        """The state of the first flat group DeepSpeed's optimizer has stepped (read when asked: a fresh engine
        has none until its first step or a load makes it)."""
        return next((st for st in self.inner.state.values() if st), {})

    @property
    def keys(self) -> list[str]:
        """The per-element optimizer state keys (Adam's ``exp_avg``...), as the engine holds them now."""
        master = next((q for q, st in self.inner.state.items() if st), None)
        return sorted(k for k, v in self.flat_state.items() if master is not None and per_element(v, master.shape))

    def pieces(self, copy: bool = True) -> Pieces:
        """DeepSpeed's calls assemble each full tensor anew: copies whatever ``copy`` says."""
        from deepspeed.utils import safe_get_full_fp32_param

        model: dict[str, Any] = {}
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        masters: dict[int, torch.Tensor] = {}  # a half-precision parameter's float32 copy
        for k, v in self.module.state_dict(keep_vars=True).items():
            full = (self._flat_master(v) if id(v) in self.flat else safe_get_full_fp32_param(v)) \
                if id(v) in by_id else None
            if full is None and hasattr(v, "ds_id"):  # a frozen parameter at stage 3: partitioned, no fp32 master
                full = self._gathered(v)
            if full is not None and v.dtype != full.dtype:
                masters[id(v)] = full
                full = full.to(v.dtype)
            model[k] = even_slice(full if full is not None else v, self.rank, self.size)
        optim: dict[str, dict[str, Any]] = {}
        keys = self.keys
        for p, name in zip(self.params, self.opt_names, strict=True) if self.optimizer is not None else ():
            # a frozen parameter is in no partition and has no state (DeepSpeed answers None for it)
            found = {key: self._full_state(p, key) for key in keys} if p.requires_grad else {}
            if id(p) in masters:
                found[MASTER] = masters[id(p)]
            optim[name] = {key: even_slice(v, self.rank, self.size) for key, v in found.items() if v is not None}
        return {"model": model, "optim": optim}

    def _flat_views(self) -> dict[int, tuple[torch.Tensor, int, int]]:
        """Stage 0 with a half-precision model (DeepSpeed's FP16_Optimizer, or FP16_UnfusedOptimizer where the
        accelerator has no fused kernels, as on CPU; its bf16 at stage 0 too): each parameter's float32 copy the
        optimizer steps, as (the tensor holding it and its state, offset, numel): the flat group (fused) or the
        parameter's own copy (unfused)."""
        halves = getattr(self.zero, "fp16_groups", None)
        flats: list[torch.Tensor] = getattr(self.zero, "fp32_groups_flat", None) or []
        copies: list[list[torch.Tensor]] = getattr(self.zero, "fp32_groups", None) or []
        if halves is None or not (flats or copies):
            return {}
        out = {}
        for gi, group in enumerate(halves):
            offset = 0
            for j, p in enumerate(group):
                out[id(p)] = (flats[gi], offset, p.numel()) if flats else (copies[gi][j], 0, p.numel())
                offset += p.numel()
        return out

    def _flat_master(self, p: torch.Tensor, key: str | None = None) -> torch.Tensor | None:
        """``p``'s float32 copy (``key`` None) or its optimizer state ``key``: a view of what holds it."""
        holder, offset, n = self.flat[id(p)]
        if key is not None:
            state = self.inner.state.get(holder, {})
            if key not in state:
                return None
            holder = state[key]
        return holder.detach().reshape(-1).narrow(0, offset, n).view(p.shape)

    def _full_state(self, p: torch.Tensor, key: str) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_full_optimizer_state

        if id(p) in self.flat:
            return self._flat_master(p, key)
        return safe_get_full_optimizer_state(p, key)  # type: ignore[no-any-return]

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
        keys = self.keys
        scalars = {k: v for k, v in self.flat_state.items() if k not in keys}
        return {"param_groups": self.settings(), "scalars": {name: scalars for p, name in
                                                             zip(self.params, self.opt_names, strict=True)
                                                             if p.requires_grad}}

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

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
        keys = sorted({k for name in self.opt_names for k in state_keys.get(name, []) if k != MASTER})
        # A fresh engine has no optimizer state yet (it is made at the first step): make it, zeros, on the
        # fp32 master partitions, and have DeepSpeed link its per-parameter views into it.
        masters = getattr(self.zero, "single_partition_of_fp32_groups", None) or \
            getattr(self.zero, "fp32_partitioned_groups_flat", None) or list({id(h): h for h, _, _ in
                                                                              self.flat.values()}.values())
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
                value = read("optim", name, key, 0, numel)
                if id(p) in self.flat:
                    view = self._flat_master(p, None if key == MASTER else key)
                    if view is not None:
                        view.copy_(value.view(view.shape))
                elif hasattr(p, "ds_id"):
                    self._set_stage3(p, value, None if key == MASTER else key)
                elif key == MASTER:
                    safe_set_full_fp32_param(p, value)
                else:
                    safe_set_full_optimizer_state(p, value, key)
        for st in self.inner.state.values():
            for k, v in saved.items():
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v
        self.set_settings(meta["param_groups"])

    def _set_stage3(self, p: Any, value: torch.Tensor, key: str | None) -> None:
        """This rank's partition of a stage-3 parameter's optimizer state. DeepSpeed 0.19.8's own
        ``set_full_hp_param`` reads past the end of the value when the parameter's size is not a multiple of
        the world size (the last partition is padded), so the padding is added here."""
        part, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        padded = torch.zeros(part.numel() * self.size, dtype=value.dtype)
        padded[: value.numel()] = value.reshape(-1)
        rank = self.zero._get_param_partition_rank(p)
        part.data.copy_(padded[rank * part.numel():(rank + 1) * part.numel()])
