"""The protocol between the checkpoint files and whatever holds the training state: a Layout.

The checkpoint speaks only of *full* tensors by name: the model's state-dict entries and, per parameter name,
the optimizer's per-element state (Adam's ``exp_avg``...) and scalars (``step``), plus the param groups'
settings. A Layout maps that to one prepared optimizer's reality, and each prepared optimizer makes its own
(``checkpoint_layout(model)``): unidist's ZeRO writes exactly the shards it owns (unidist/train/zero_layout.py),
a DeepSpeed engine assembles its partitions with DeepSpeed's calls (unidist/engines/deepspeed/trainer.py), and state
every rank holds whole (plain data parallelism on any backend) is written as an even 1/N slice of every
tensor by ``FullLayout`` here, which needs nothing but a module and a torch optimizer.

A Layout also says over which ranks its state is spread (``rank``, ``size``: its place in that data-parallel
communicator; ``ranks``: their world ranks). A model prepared with ``group=`` inside a tensor or pipeline
parallel job saves one set of shards per data-parallel group (a *part*), so this module never needs to know
how the training layer shards anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unidist.errors import CheckpointCorruptError, CheckpointMismatchError

__all__ = ["MASTER", "FullLayout", "Layout", "Pieces", "Read", "check_params", "dtype_named", "even", "even_slice",
           "first_names", "fresh_scalars",
           "load_whole_optimizer", "param_names", "per_element"]

# the per-element "optimizer" key under which a parameter's master copy is saved (precision "bf16-master": the
# optimizer steps float32 copies of a bfloat16 model), as DeepSpeed keeps its fp32 copies with the optimizer; it is
# not optimizer state: each layout restores it to the copies, or leaves it where the run keeps none
MASTER = "master"

Pieces = dict[str, Any]  # {"model": {name: (start, flat)}, "optim": {pname: {key: (start, flat)}}}
Read = Callable[[str, str, str, int, int], torch.Tensor]  # (kind, name, key, start, end) -> flat slice


def dtype_named(name: str) -> torch.dtype:
    """The dtype a layout's ``shapes`` (and a manifest) record by name, ``"torch.float32"``."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointCorruptError(f"the checkpoint names dtype {name!r}, which this torch does not have")
    return dt


def even(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's slice [start, end) of n elements split into near-equal parts."""
    chunk = -(-n // size) if n else 0
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


def even_slice(t: torch.Tensor, rank: int, size: int, copy: bool = True) -> tuple[int, torch.Tensor]:
    """(start, copy) of rank's even slice of the flattened tensor (``copy=False``: a view where it can be one)."""
    flat = t.detach().reshape(-1)
    s, e = even(flat.numel(), rank, size)
    return s, flat[s:e].clone() if copy else flat[s:e]


class Layout:
    """Base: the full state's description (names, shapes, dtypes) is common to every backend.

    Subclasses set the attributes below and implement ``pieces``, ``meta`` (or use this one's helpers) and
    ``load``; ``pieces`` may be a collective (every rank calls it, in the same order)."""

    rank: int  # this rank's place in the data-parallel communicator the state is spread over
    size: int
    ranks: tuple[int, ...]  # that communicator's world ranks (a part of the checkpoint, see module docstring)
    zero_stage: int = 0  # recorded in the manifest (informational: the format does not depend on it)
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

    def without_optimizer(self) -> Layout:
        """The same layout for the model only (``optimizer=None`` at save or load)."""
        self.optimizer = None
        return self

    def pieces(self, copy: bool = True) -> Pieces:
        """This rank's slices: ``{"model": {name: (start, flat)}, "optim": {pname: {key: (start, flat)}}}``, as
        copies (never views of live tensors): a background save writes them while training changes the state;
        ``copy=False``: views where they can be, for a reader done before the state changes (a load's proof)."""
        raise NotImplementedError

    params: list[torch.Tensor]  # the optimizer's parameters, in the order of ``opt_names``

    def state_holder(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer keeps ``p``'s state under (``p`` itself, or the shard holding it)."""
        return p

    def meta(self) -> dict[str, Any]:
        """Non-element optimizer data: param-group settings and per-parameter scalars (rank-identical)."""
        if self.optimizer is None:
            return {"param_groups": [], "scalars": {}}
        scalars = {}
        for p, name in zip(self.params, self.opt_names, strict=True):
            holder = self.state_holder(p)
            scalars[name] = {k: v for k, v in self.optimizer.state.get(holder, {}).items()
                             if not per_element(v, holder.shape)}
        return {"param_groups": self.settings(), "scalars": scalars}

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        """Read this rank's part of every full tensor (``read``) into the model and optimizer."""
        raise NotImplementedError

    def settings(self) -> list[dict[str, Any]]:
        """The param groups' settings (everything but ``params``), as saved in ``meta``."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def set_settings(self, groups: list[dict[str, Any]]) -> None:
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(saved)


def check_params(path: Any, saved: dict[str, int], want: dict[str, Any],
                 canonical: Callable[[str], str] = str) -> None:
    """The optimizer ``want`` (a ``describe()``'s) updates the parameters ``saved`` holds state for (name -> param
    group), each in the same group; else a CheckpointMismatchError naming the first that differs. ``canonical``: the
    checkpoint's name for one of ours (a tied weight saved under another of its names)."""
    ours = [canonical(n) for n in want["params"]]
    for name, group in zip(ours, want["groups"], strict=True):
        if name not in saved:
            raise CheckpointMismatchError(f"{path}: the optimizer updates {name!r}, which the checkpoint's does not")
        if saved[name] != group:
            raise CheckpointMismatchError(f"{path}: {name!r} is in param group {saved[name]} in the checkpoint and "
                                          f"in group {group} here")
    if len(saved) != len(ours):
        extra = next(n for n in saved if n not in set(ours))
        raise CheckpointMismatchError(f"{path}: the checkpoint's optimizer updates {extra!r}, this one does not")


def param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def first_names(module: torch.nn.Module) -> dict[str, str]:
    """Every parameter name -> the parameter's first name (``named_parameters``' order): the name torch's
    ``get_state_dict`` keeps a tied weight's optimizer state under (``param_names`` gives its last)."""
    first: dict[int, str] = {}
    for n, p in module.named_parameters():
        first.setdefault(id(p), n)
    return {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}


def fresh_scalars(saved: dict[str, Any]) -> dict[str, Any]:
    """Fresh copies: parameters saved from one ZeRO unit share their step tensor, and optimizers increment
    step tensors in place, once per parameter."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}


def per_element(value: Any, shape: torch.Size | tuple[int, ...]) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(shape)


class FullLayout(Layout):
    """Every rank holds every tensor (stage 0 on any backend): each writes an even slice of each."""

    def __init__(self, rank: int, size: int, module: torch.nn.Module, optimizer: Any,
                 ranks: tuple[int, ...] | None = None, names: dict[int, str] | None = None) -> None:
        """``names``: each optimizer parameter's name by ``id`` (default: the module's own parameters')."""
        self.rank, self.size, self.module, self.optimizer = rank, size, module, optimizer
        self.ranks = ranks if ranks is not None else tuple(range(size))
        self.shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in module.state_dict().items()}
        names = names if names is not None else param_names(module)
        params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
        self.params = params
        self.opt_names = [names[id(p)] for p in params]
        self.opt_groups = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]] \
            if optimizer is not None else []

    def pieces(self, copy: bool = True) -> Pieces:
        model = {k: even_slice(v, self.rank, self.size, copy) for k, v in self.module.state_dict().items()}
        optim: dict[str, dict[str, Any]] = {}
        for p, name in zip(self.params, self.opt_names, strict=True) if self.optimizer is not None else ():
            st = self.optimizer.state.get(p, {})
            optim[name] = {k: even_slice(v, self.rank, self.size, copy) for k, v in st.items()
                           if per_element(v, p.shape)}
        return {"model": model, "optim": optim}

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        full = {}
        for k, (shape, _) in self.shapes.items():
            n = int(torch.Size(shape).numel())
            full[k] = read("model", k, "", 0, n).view(shape)
        self.module.load_state_dict(full, strict=True)
        if self.optimizer is not None:
            load_whole_optimizer(self.optimizer, self.params, self.opt_names, read, meta, state_keys)


def load_whole_optimizer(optimizer: Any, params: list[torch.Tensor], names: list[str], read: Read,
                         meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
    """A torch optimizer every rank holds whole, from the checkpoint's per-name full state: ``params`` in the
    optimizer's order and each one's name in the checkpoint (``MASTER`` copies are not optimizer state)."""
    state: dict[int, dict[str, Any]] = {}
    for i, (p, name) in enumerate(zip(params, names, strict=True)):
        entry = {k: read("optim", name, k, 0, p.numel()).view(p.shape) for k in state_keys.get(name, [])
                 if k != MASTER}
        entry.update(fresh_scalars(meta["scalars"].get(name, {})))
        if entry:
            state[i] = entry
    groups, start = [], 0
    for g, saved in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        groups.append({**saved, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
