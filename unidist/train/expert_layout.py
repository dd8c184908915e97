"""The checkpoint layout of a model with Mixture-of-Experts layers (``unidist.parallel.moe``) at ZeRO stage 0.

Ranks hold different experts, so the checkpoint speaks of the *layer's* experts: a parameter of local expert i on
the rank at place p of an expert-parallel group of ``ep_size`` is saved under the name of expert ``p * E/ep + i``
(``comm.param_comm.ExpertSlot``), written in even slices by the ranks that hold it (its expert-data-parallel
group), and read back by whichever ranks hold that expert when loading: at another world size, or with the experts
spread over another number of ranks, as long as the layer has the same number of experts. Everything else is
whole on every rank and written in even slices by all of them, as ``FullLayout`` does. The manifest describes the
whole model (every expert of every layer), so a checkpoint is checked against the layer, not against one rank.
"""

from __future__ import annotations

from typing import Any

import torch

from unidist.checkpoint.layout import Layout, Pieces, Read, even_slice, load_whole_optimizer, param_names, per_element
from unidist.comm.param_comm import ExpertSlot, expert_slot_of, reduce_comm_of
from unidist.comm.protocol import Comm, world_ranks

__all__ = ["ExpertLayout"]


class ExpertLayout(Layout):
    """See the module docstring: ``dp`` is the data-parallel communicator the model was prepared over."""

    def __init__(self, dp: Comm, module: torch.nn.Module, optimizer: Any) -> None:
        self.rank, self.size, self.ranks = dp.rank, dp.size, world_ranks(dp)
        self.module, self.optimizer = module, optimizer
        names = param_names(module)
        self.slots: dict[int, ExpertSlot] = {}
        self.holders: dict[int, tuple[int, int]] = {}  # an expert parameter's (rank, size) among the ranks holding it
        for p in module.parameters():
            slot, mark = expert_slot_of(p), reduce_comm_of(p)
            if slot is not None and mark is not None:
                self.slots[id(p)] = slot
                self.holders[id(p)] = (mark.comm.rank, mark.comm.size)
        state = module.state_dict(keep_vars=True)
        self.local = state
        self.global_of = {k: self._name(k, v) for k, v in state.items()}
        self.shapes = {}
        for k, v in state.items():
            for name in self._every_name(k, v):
                self.shapes[name] = (tuple(v.shape), str(v.dtype))
        self.params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.opt_names = [self._name(names[id(p)], p) for p in self.params]
        self.opt_groups = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]] \
            if optimizer is not None else []
        self.local_names = [names[id(p)] for p in self.params]

    def _name(self, key: str, t: torch.Tensor) -> str:
        slot = self.slots.get(id(t))
        return slot.global_name(key) if slot is not None else key

    def _every_name(self, key: str, t: torch.Tensor) -> list[str]:
        """The names of ``key`` over the whole layer: an expert's at every place of its expert-parallel group."""
        slot = self.slots.get(id(t))
        return [key] if slot is None else [slot.global_name(key, place) for place in range(slot.ep_size)]

    def _slice(self, t: torch.Tensor, holder: torch.Tensor, copy: bool = True) -> tuple[int, torch.Tensor]:
        """This rank's even slice of ``t``: among the ranks holding the same expert, or among all."""
        rank, size = self.holders.get(id(holder), (self.rank, self.size))
        return even_slice(t, rank, size, copy)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.shapes.items()}}
        if self.optimizer is not None:
            params, groups = [], []
            for p, local, gi in zip(self.params, self.local_names, self.opt_groups, strict=True):
                for every in self._every_name(local, p):
                    params.append(every)
                    groups.append(gi)
            out["optimizer"] = {"class": type(self.optimizer).__name__, "params": params, "groups": groups}
        return out

    def meta(self) -> dict[str, Any]:
        """Scalars per parameter, an expert's under every place's name (the experts of a layer step together)."""
        base = super().meta()
        if self.optimizer is not None:
            scalars = base["scalars"]
            for p, name, local in zip(self.params, self.opt_names, self.local_names, strict=True):
                for every in self._every_name(local, p):
                    scalars[every] = scalars[name]
        return base

    def pieces(self, copy: bool = True) -> Pieces:
        model = {self.global_of[k]: self._slice(v, v, copy) for k, v in self.module.state_dict(keep_vars=True).items()}
        optim: dict[str, dict[str, Any]] = {}
        for p, name in zip(self.params, self.opt_names, strict=True) if self.optimizer is not None else ():
            st = self.optimizer.state.get(p, {})
            optim[name] = {k: self._slice(v, p, copy) for k, v in st.items() if per_element(v, p.shape)}
        return {"model": model, "optim": optim}

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        full = {}
        for k, v in self.local.items():
            full[k] = read("model", self.global_of[k], "", 0, v.numel()).view(v.shape)
        self.module.load_state_dict(full, strict=True)
        if self.optimizer is not None:
            load_whole_optimizer(self.optimizer, self.params, self.opt_names, read, meta, state_keys)
