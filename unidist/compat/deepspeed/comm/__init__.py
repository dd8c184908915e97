"""``deepspeed.comm``: DeepSpeed's collective functions, on torch.distributed, on every unidist backend.

DeepSpeed's comm is a thin layer over torch.distributed (its TorchBackend, ds/comm/torch.py): the same is done
here, on the world ``init_distributed`` made (or adopted). Signatures are DeepSpeed's (ds/comm/comm.py):
``group=None`` is the world, ``async_op=True`` returns torch's Work, tensors are reduced in place; DeepSpeed's
comms-logging arguments (``prof``, ``log_name``, ``debug``) are accepted and ignored. ``ReduceOp`` is
DeepSpeed's own enum (ds/comm/reduce_op.py), mapped to torch's as TorchBackend._reduce_op does
(ds/comm/torch.py:558-576); torch's own ops pass through.

Before ``init_distributed`` DeepSpeed asserts ``'DeepSpeed backend not set, please initialize it using
init_process_group()'`` (or fails on ``None.all_reduce``); here every call raises unidist's
NotInitializedError with that text (a RuntimeError). ``destroy_process_group()`` of the world ends the compat
world; on the torch and deepspeed backends the Manager's group itself stays until the Manager shuts down
(destroying it under the Manager would break the Manager's last barrier).
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Any

import torch

from unidist.compat.deepspeed.dist import init_distributed
from unidist.compat.deepspeed.dist import is_initialized as _compat_initialized
from unidist.compat.deepspeed.dist import shutdown as _shutdown
from unidist.compat.deepspeed.missing import uncovered
from unidist.errors import InvalidArgumentError, NotInitializedError

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

_NOT_SET = "DeepSpeed backend not set, please initialize it using init_process_group()"  # ds/comm/comm.py:750


class ReduceOp(Enum):
    """DeepSpeed's reduce operations (ds/comm/reduce_op.py: the same names and values)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def _torch_op(op: Any) -> Any:
    """torch's op for DeepSpeed's (torch's own pass through, as in TorchBackend._reduce_op)."""
    if not isinstance(op, ReduceOp):
        return op
    if op is ReduceOp.UNUSED:
        raise InvalidArgumentError("ReduceOp.UNUSED is not an operation; use SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR "
                                   "or BXOR")
    return getattr(torch.distributed.ReduceOp, op.name)


def _need() -> Any:
    if not _compat_initialized():
        raise NotInitializedError(f"{_NOT_SET} (call deepspeed.init_distributed() or deepspeed.initialize() first)")
    return torch.distributed


# ------------------------------------------------------------------ state and groups
def is_initialized() -> bool:
    """True after ``init_distributed`` (DeepSpeed: its backend object exists and torch's world is up)."""
    return _compat_initialized()


def is_available() -> bool:
    """DeepSpeed's comm package is always available (comm.py:207)."""
    return True


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the world by default); -1 outside the group (torch's answer)."""
    return int(_need().get_rank(group))


def get_world_size(group: Any = None) -> int:
    """Ranks in ``group`` (the world by default)."""
    return int(_need().get_world_size(group))


def get_local_rank() -> int:
    """LOCAL_RANK (then OMPI_COMM_WORLD_LOCAL_RANK, then 0), as DeepSpeed reads it (ds/comm/utils.py:11-23)."""
    _need()
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The world rank of ``group``'s rank ``group_rank`` (the world by default)."""
    dist = _need()
    return int(dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank))


def get_world_group() -> Any:
    """The world process group."""
    return _need().group.WORLD


def new_group(ranks: list[int]) -> Any:
    """A process group of ``ranks`` (every rank must call it, as torch's)."""
    return _need().new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group``; the world (None): end the compat world (see the module docstring)."""
    dist = _need()
    if group is None or group is dist.group.WORLD:
        _shutdown()
    else:
        dist.destroy_process_group(group)


# ------------------------------------------------------------------ collectives (DeepSpeed's signatures)
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    """Reduce ``tensor`` over the ranks, in place."""
    return _need().all_reduce(tensor, op=_torch_op(op), group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           prof: bool = False, log_name: str = "reduce", debug: Any = None) -> Any:
    """Reduce ``tensor`` onto rank ``dst``, in place there."""
    return _need().reduce(tensor, dst=dst, op=_torch_op(op), group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug: Any = None) -> Any:
    """Rank ``src``'s ``tensor`` into every rank's, in place."""
    return _need().broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Any = None) -> Any:
    """Every rank's ``tensor`` into ``tensor_list`` (one entry per rank)."""
    return _need().all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                           debug: Any = None) -> Any:
    """Every rank's ``tensor`` concatenated, in rank order, into ``output_tensor`` (world size times larger)."""
    dist = _need()
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13 (the old name warns)
        return dist.all_gather_single(output_tensor, tensor, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Any = None) -> Any:
    """Reduce ``tensor`` over the ranks; rank r receives the r-th of world-size equal slices."""
    dist = _need()
    if hasattr(dist, "reduce_scatter_single"):  # torch >= 2.13 (the old name warns)
        return dist.reduce_scatter_single(output_tensor, tensor, op=_torch_op(op), group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=_torch_op(op), group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False,
                 debug: Any = None) -> Any:
    """DeepSpeed's name for ``all_gather_into_tensor`` (comm.py:352)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                      async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's name for ``reduce_scatter_tensor`` (comm.py:283)."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                      prof: bool = False, log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    """torch's all_to_all_single (gloo supports it on CPU)."""
    return _need().all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                     async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter",
                   debug: Any = None) -> Any:
    """Reduce ``input_list`` (one tensor per rank) over the ranks; rank r receives the r-th into ``output``."""
    return _need().reduce_scatter(output, input_list, op=_torch_op(op), group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_to_all", debug: Any = None) -> Any:
    """Rank r's ``input_tensor_list[s]`` into rank s's ``output_tensor_list[r]``."""
    return _need().all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "gather", debug: Any = None) -> Any:
    """Every rank's ``tensor`` into ``gather_list`` on rank ``dst``."""
    return _need().gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, prof: bool = False, log_name: str = "scatter", debug: Any = None) -> Any:
    """Rank ``src``'s ``scatter_list[r]`` into rank r's ``tensor``."""
    return _need().scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False, prof: bool = False,
                      log_name: str = "monitored_barrier", debug: Any = None) -> Any:
    """A barrier that names the ranks that did not arrive within ``timeout`` (gloo)."""
    return _need().monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None, prof: bool = False,
            log_name: str = "barrier", debug: Any = None) -> Any:
    """Wait for every rank of ``group``."""
    return _need().barrier(group=group, async_op=async_op, device_ids=device_ids)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None,
                          prof: bool = False, log_name: str = "broadcast_object_list", debug: Any = None) -> None:
    """Rank ``src``'s picklable objects into every rank's ``object_list``, in place."""
    _need().broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: Any = None) -> None:
    """Every rank's ``obj`` into ``object_list`` (one entry per rank)."""
    _need().all_gather_object(object_list, obj, group=group)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> None:
    """Send ``tensor`` to rank ``dst`` (blocking)."""
    _need().send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug: Any = None) -> int:
    """Receive into ``tensor`` from rank ``src`` (any when None); returns the sender."""
    return int(_need().recv(tensor, src=src, group=group, tag=tag))


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Any = None) -> Any:
    """Send without waiting; returns torch's Work."""
    return _need().isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug: Any = None) -> Any:
    """Receive without waiting; returns torch's Work."""
    return _need().irecv(tensor, src=src, group=group, tag=tag)


def has_all_gather_into_tensor() -> bool:
    """Whether torch.distributed has ``all_gather_into_tensor`` (every torch this layer supports has it)."""
    return hasattr(torch.distributed, "all_gather_into_tensor")


__getattr__ = uncovered(__name__)
