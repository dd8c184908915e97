"""Horovod's helpers built on collectives: parameter, optimizer-state and object broadcasts.

``broadcast_parameters`` takes what Horovod takes (a dict such as ``model.state_dict()``, or a list of
parameters or of ``(name, parameter)`` pairs) and fuses the broadcast per dtype (unidist's
``broadcast_parameters``) instead of one call per tensor: the values are the same.

``broadcast_optimizer_state`` is Horovod's, step for step, because a script written for Horovod must end with
Horovod's weights: on a rank whose optimizer has no state yet it first gives every parameter that requires a
gradient a zero gradient (sparse for ``SparseAdam``, and for SGD on a sparse embedding of ``model``) and takes one
step of the wrapped optimizer's own class, without any reduction, so that the state exists. That step is not
neutral: with weight decay it moves each weight by ``lr * wd * w`` and seeds the momentum buffer with ``wd * w``;
Adam starts its bias correction at step 1. Then rank ``root_rank``'s state (tensors and scalars such as ``step``)
and ``param_groups`` options are loaded on every rank. As in Horovod the decision is each rank's own: on a resume
where only rank 0 loaded a checkpoint, the other ranks take the zero step (their weights then move and rank 0's do
not). ``unidist``'s own ``mgr.broadcast_optimizer_state`` takes no such step.

Objects travel with cloudpickle when it is installed (as Horovod, which depends on it: lambdas and local
classes work), else with pickle.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from unidist.compat.horovod import collectives
from unidist.compat.horovod.basics import manager
from unidist.compat.horovod.process_sets import ProcessSet, global_process_set
from unidist.errors import InvalidArgumentError

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle  # type: ignore[import-untyped, import-not-found, unused-ignore]  # optional, untyped
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return buf.getvalue()


def _check_root(root_rank: int) -> None:
    size = manager().size
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise InvalidArgumentError(f"root_rank={root_rank!r} is not a rank of this job (0..{size - 1})")


def broadcast_parameters(params: Mapping[str, torch.Tensor] | list[Any], root_rank: int) -> None:
    """Rank ``root_rank``'s tensors, in place, on every rank.

    Args:
        params: a dict of tensors (``model.state_dict()``; broadcast in sorted key order, as Horovod) or a list
            of tensors or of ``(name, tensor)`` pairs (``list(model.named_parameters())``). Anything else is a
            ValueError, as in Horovod (a generator such as ``model.parameters()`` must be made a list).
        root_rank: the rank whose values everyone gets.
    """
    if isinstance(params, dict):
        named = sorted(params.items())
    elif isinstance(params, list):
        named = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise InvalidArgumentError(f"invalid params of type: {type(params)} (broadcast_parameters takes a dict "
                                   "such as model.state_dict() or a list such as list(model.named_parameters()))")
    _check_root(root_rank)
    manager().broadcast_parameters([(str(name), t) for name, t in named], root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Rank ``root_rank``'s optimizer state and options on every rank, after Horovod's zero-gradient step on a rank
    whose optimizer has no state yet (see the module docstring).

    Args:
        optimizer: a torch optimizer or this module's DistributedOptimizer.
        root_rank: the rank whose state everyone gets.
        model: used, as in Horovod, to find sparse embeddings (their zero gradient is sparse for SGD).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgumentError("cannot broadcast torch.optim.LBFGS state (as in Horovod: its state is nested "
                                   "Python objects; build the same LBFGS on every rank from broadcast parameters)")
    _check_root(root_rank)
    if len(optimizer.state_dict()["state"]) == 0:
        _zero_gradient_step(optimizer, model)
    manager().broadcast_optimizer_state(optimizer, root_rank)


def _zero_gradient_step(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's state initialisation (horovod/torch/functions.py ``broadcast_optimizer_state``): a zero gradient for
    every parameter that requires one, then the wrapped optimizer class's own step, with no reduction (a
    DistributedOptimizer's step would reduce, and deadlock unless every rank took it). The gradients stay zeros."""
    sparse = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse
              for p in m.parameters()} if model is not None else set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = p.data.new(p.size()).zero_()
                if isinstance(optimizer, torch.optim.SparseAdam) or (isinstance(optimizer, torch.optim.SGD)
                                                                     and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    local = getattr(optimizer, "step_without_reduction", None)  # this module's DistributedOptimizers
    (local if local is not None else optimizer.step)()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Rank ``root_rank``'s object on every rank of ``process_set``, serialized as Horovod does (a size, then
    the bytes, each a broadcast named ``name + '.sz'`` / ``'.t'``; ``name`` defaults to the object's type)."""
    name = type(obj).__name__ if name is None else name
    if manager().rank == root_rank:
        data = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
        collectives.broadcast_(torch.tensor([data.numel()], dtype=torch.int32), root_rank, name + ".sz", process_set)
    else:
        sz = torch.zeros(1, dtype=torch.int32)
        collectives.broadcast_(sz, root_rank, name + ".sz", process_set)
        data = torch.empty(int(sz.item()), dtype=torch.uint8)
    collectives.broadcast_(data, root_rank, name + ".t", process_set)
    if manager().rank == root_rank:
        return obj
    return pickle.loads(data.numpy().tobytes())  # peers of one job are trusted (README, Security)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's object, as a list indexed by rank (two allgathers: the sizes, then the bytes)."""
    name = type(obj).__name__ if name is None else name
    data = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    sizes = collectives.allgather(torch.tensor([data.numel()], dtype=torch.int32), name=name + ".sz").tolist()
    gathered = collectives.allgather(data, name=name + ".t").numpy()
    out, start = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[start:start + n].tobytes()))  # trusted peers
        start += n
    return out
