"""Master copies for a low-precision model (``prepare(precision="bf16-master")``) where every rank holds the whole
optimizer (ZeRO stage 0: the DistributedOptimizer).

The model's parameters stay bfloat16: the forward, the backward and the gradients' averaging run in it. The
user's optimizer is given float32 copies of them instead (its ``param_groups`` rewritten in place, as ZeRO
rewrites them to shards), made from the bfloat16 weights, so they start where the model is, as DeepSpeed's
``bf16`` optimizers make theirs. Each step: the averaged gradients are copied up into the copies' ``.grad``
(where loss-scale checks and clipping read them, in float32), the optimizer steps the copies, and the model's
parameters are written from them, rounded once. ZeRO stages 1-3 need none of this: their shards are the copies
(zero_unit.py, ``master=``).
"""

from __future__ import annotations

from typing import Any

import torch

from unidist.checkpoint.layout import MASTER, FullLayout, Pieces, Read, even_slice, param_names

__all__ = ["Masters", "MastersLayout"]


class Masters:
    """The float32 copies ``optimizer`` steps in place of the model's parameters (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the model's parameter, its master copy)
        made: dict[int, torch.Tensor] = {}
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if not p.requires_grad:  # frozen: never stepped, so no copy (the group keeps the parameter)
                    params.append(p)
                    continue
                if id(p) not in made:
                    master = torch.nn.Parameter(p.detach().to(dtype, copy=True))
                    made[id(p)] = master
                    self.pairs.append((p, master))
                params.append(made[id(p)])
            group["params"] = params
        # state the optimizer already had (a resumed optimizer handed to prepare) follows its parameter
        state = optimizer.state
        for p, m in self.pairs:
            if p in state:
                state[m] = state.pop(p)
        self.of = {id(p): m for p, m in self.pairs}

    def add_group(self, group: dict[str, Any]) -> None:
        """A param group added after prepare (``add_param_group``): its parameters get copies too."""
        fresh = [p for p in group["params"] if id(p) not in self.of and p.requires_grad]
        for p in fresh:
            master = torch.nn.Parameter(p.detach().to(self.dtype, copy=True))
            self.pairs.append((p, master))
            self.of[id(p)] = master
        group["params"] = [self.of.get(id(p), p) for p in group["params"]]

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The copy the optimizer steps for ``param`` (None: not one of its parameters)."""
        return self.of.get(id(param))

    def take_grads(self) -> None:
        """The averaged gradients, up in the copies' dtype (None stays None: that parameter is not stepped)."""
        with torch.no_grad():
            for p, m in self.pairs:
                m.grad = None if p.grad is None else p.grad.to(self.dtype)

    def write_back(self) -> None:
        """The stepped copies into the model's parameters, rounded once."""
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)

    def reload(self) -> None:
        """The copies from the model's parameters (a checkpoint without master copies was loaded into them)."""
        with torch.no_grad():
            for p, m in self.pairs:
                m.copy_(p)

    def clear(self, set_to_none: bool) -> None:
        """The model's gradients cleared with the copies' (the optimizer clears those)."""
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()


class MastersLayout(FullLayout):
    """Every rank holds everything (stage 0) and the optimizer steps master copies: each copy is named as its
    parameter, and saved beside the optimizer's state under ``MASTER`` (checkpoint/layout.py), so a resumed run
    continues from the copies, not from the rounded weights; a checkpoint without them starts the copies from the
    weights it loads."""

    def __init__(self, rank: int, size: int, module: torch.nn.Module, optimizer: Any, ranks: tuple[int, ...],
                 masters: Masters) -> None:
        names = param_names(module)
        self.masters = masters
        super().__init__(rank, size, module, optimizer, ranks,
                         names={**names, **{id(m): names[id(p)] for p, m in masters.pairs if id(p) in names}})

    def pieces(self, copy: bool = True) -> Pieces:
        out = super().pieces(copy)
        copies = {id(m) for _, m in self.masters.pairs}
        if self.optimizer is not None:
            for m, name in zip(self.params, self.opt_names, strict=True):
                if id(m) in copies:  # a frozen parameter, in the group itself, has none
                    out["optim"].setdefault(name, {})[MASTER] = even_slice(m, self.rank, self.size, copy)
        return out

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        super().load(read, meta, state_keys)
        self.masters.reload()  # from the loaded weights; then the saved copies where the checkpoint has them
        if self.optimizer is None:
            return
        with torch.no_grad():
            for m, name in zip(self.params, self.opt_names, strict=True):
                if MASTER in state_keys.get(name, []) and m.requires_grad:
                    m.copy_(read("optim", name, MASTER, 0, m.numel()).view(m.shape))
