"""The raw Horovod collectives over a process set's communicator: validation, scaling, handles, names.

``ops.py`` is the public API (signatures, autograd); each call here starts one collective on the Manager or a
Group and returns a ``Pending`` whose ``wait()`` gives Horovod's output. Horovod's math, measured against
horovod 0.28.1 (tests/workers/hvd_api.py compares the two case by case):

- ``prescale_factor`` multiplies each rank's input before the reduction; ``Average`` is a sum followed by
  one multiplication by ``postscale_factor / size``; ``Sum``/``Min``/``Max``/``Product`` multiply by
  ``postscale_factor`` after. On integer tensors every scaling is done in double precision and truncated
  toward zero (so an integer ``Average`` truncates: 7 / 2 -> 3, -5 / 2 -> -2).
- Reductions take int32, int64, float16, float32, float64; allgather, broadcast and alltoall also uint8, int8
  and int16 (Horovod's kernels); other dtypes, non-tensors and non-contiguous tensors raise its errors.

Handles are ints in a module map, as Horovod's. Async calls whose engine has no asynchronous form here
(grouped calls, alltoall, Adasum) run at once and their handle is already done.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from unidist.compat.horovod.exceptions import HorovodInternalError
from unidist.compat.horovod.process_sets import ProcessSet, comm_of, global_process_set
from unidist.errors import CollectiveMismatchError, InvalidArgumentError
from unidist.ops import ReduceOp

__all__ = [
    "Adasum", "Average", "Max", "Min", "NotATensorError", "Pending", "Product", "ScalarInputError", "Sum",
    "allgather_start", "allreduce_now", "allreduce_start", "alltoall_start", "broadcast_start", "compress",
    "decompress", "grad_mode", "grouped_allreduce_start", "reducescatter_start", "resolve_op", "scale_",
]

# Horovod's reduction op values (horovod_reduce_op_* in its C++ library).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_ENGINE_OP = {Average: ReduceOp.SUM, Sum: ReduceOp.SUM, Min: ReduceOp.MIN, Max: ReduceOp.MAX,
              Product: ReduceOp.PRODUCT}
REDUCE_DTYPES = frozenset({torch.int32, torch.int64, torch.float16, torch.float32, torch.float64})
MOVE_DTYPES = REDUCE_DTYPES | {torch.uint8, torch.int8, torch.int16}


class NotATensorError(InvalidArgumentError, AttributeError):
    """A Horovod op got something that is not a torch tensor (Horovod fails with an AttributeError)."""


class ScalarInputError(InvalidArgumentError, IndexError):
    """allgather of a 0-d tensor: Horovod fails with an IndexError; reshape(1) first."""


class Pending:
    """One started collective: ``done()`` polls, ``wait()`` completes it and returns Horovod's output."""

    __slots__ = ("finish", "handle", "name")

    def __init__(self, handle: Any, finish: Callable[[], Any], name: str | None = None) -> None:
        self.handle = handle  # a unidist Handle, or None when the work is already done
        self.finish = finish
        self.name = name

    def done(self) -> bool:
        return self.handle is None or bool(self.handle.done())

    def wait(self) -> Any:
        if self.handle is not None:
            self.handle.wait()
        return self.finish()


def _done(value: Any) -> Pending:
    return Pending(None, lambda: value)


# --------------------------------------------------------------------------------------------- checks
def resolve_op(op: int | None, average: bool | None) -> int:
    """Horovod's ``average=`` (deprecated) and ``op=`` arguments: op wins, both is an error, default Average."""
    if op is not None:
        if average is not None:
            raise InvalidArgumentError('The op parameter supersedes average. Please provide only one of them.')
        return op
    if average is not None:
        warnings.warn('Parameter `average` has been replaced with `op` and will be removed in v1.0',
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def check_tensor(tensor: Any, dtypes: frozenset[torch.dtype] = REDUCE_DTYPES) -> torch.Tensor:
    """Horovod's input checks: a torch tensor of a dtype its kernels take, contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise NotATensorError(f"Horovod ops take torch tensors, got {type(tensor).__name__}; convert it with "
                              "torch.as_tensor first")
    if tensor.dtype not in dtypes:
        raise InvalidArgumentError(f'Tensor type {tensor.type()} is not supported.')
    if not tensor.is_contiguous():
        raise InvalidArgumentError('Tensor is required to be contiguous.')
    return tensor


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place as Horovod does: in the tensor's precision for floats, in double then truncated
    toward zero for integers."""
    if t.is_floating_point():
        return t.mul_(factor)
    return t.copy_(t.to(torch.float64).mul_(factor).to(t.dtype))


def grad_mode(*tensors: Any) -> bool:
    """Whether a call records autograd (then it goes through its autograd Function)."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def compress(compression: Any, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    return (tensor, None) if compression is None else compression.compress(tensor)  # type: ignore[no-any-return]


def decompress(compression: Any, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    return tensor if compression is None else compression.decompress(tensor, ctx)  # type: ignore[no-any-return]


def _engine_op(op: int) -> ReduceOp:
    found = _ENGINE_OP.get(op)
    if found is None:
        raise HorovodInternalError("Reduction op type not supported.")
    return found


def _check_names(comm: Any, call: str, name: str | None) -> None:
    """Under UNIDIST_CHECK_COLLECTIVES, ranks compare a named call's name (one object allgather): Horovod
    matches calls by name, unidist by order, so a mismatch would otherwise reduce unrelated tensors."""
    if name is None or not comm.checks_collectives:
        return
    names = comm.allgather_object(str(name))
    if any(n != names[0] for n in names):
        raise CollectiveMismatchError(f"{call}: ranks passed different names: " +
                                      "; ".join(f"rank {r}: {n!r}" for r, n in enumerate(names)))


def _adasum(comm: Any, tensors: list[torch.Tensor], process_set: ProcessSet) -> None:
    from unidist.compat.horovod import adasum

    adasum.check_adasum(comm.size, process_set is global_process_set)
    adasum.adasum_(comm, tensors)


def _adasum_set_first(op: int, process_set: ProcessSet) -> None:
    """Horovod refuses Adasum on a non-global process set before anything else, on every rank (members or not)."""
    if op == Adasum and process_set is not global_process_set:
        from unidist.compat.horovod import adasum

        adasum.check_adasum(2, False)


# --------------------------------------------------------------------------------------------- starts
def _allreduce_prepare(tensor: Any, inplace: bool, pre: float, process_set: ProcessSet,
                       name: str | None) -> tuple[Any, torch.Tensor]:
    comm = comm_of(process_set, "Allreduce")
    check_tensor(tensor)
    _check_names(comm, "allreduce", name)
    buf = _writable(tensor) if inplace else tensor.clone()
    if pre != 1.0:
        scale_(buf, pre)
    return comm, buf


def _writable(t: torch.Tensor) -> torch.Tensor:
    """The storage an in-place op writes: Horovod's kernels write parameters (leaves that require grad)
    outside autograd, as a detached view does here."""
    return t.detach() if t.requires_grad else t


def _adasum_one(comm: Any, buf: torch.Tensor, post: float, process_set: ProcessSet) -> torch.Tensor:
    _adasum(comm, [buf], process_set)
    return scale_(buf, post) if post != 1.0 else buf


def allreduce_start(tensor: Any, inplace: bool, op: int, prescale: float, postscale: float,
                    process_set: ProcessSet, name: str | None) -> Pending:
    _adasum_set_first(op, process_set)
    comm, buf = _allreduce_prepare(tensor, inplace, prescale, process_set, name)
    if op == Adasum:
        _adasum_one(comm, buf, postscale, process_set)
        return _done(tensor if inplace else buf)
    handle = comm.allreduce_async_(buf, _engine_op(op))
    factor = postscale / comm.size if op == Average else postscale
    out = tensor if inplace else buf
    if factor == 1.0:
        return Pending(handle, lambda: out, name)

    def finish() -> torch.Tensor:
        scale_(buf, factor)
        return out  # type: ignore[no-any-return]
    return Pending(handle, finish, name)


def allreduce_now(tensor: Any, inplace: bool, op: int, prescale: float, postscale: float,
                  process_set: ProcessSet, name: str | None) -> torch.Tensor:
    """The blocking allreduce: the communicator's lean in-place path, no handle (it runs per gradient)."""
    comm, buf = _allreduce_prepare(tensor, inplace, prescale, process_set, name)
    if op == Adasum:
        _adasum_one(comm, buf, postscale, process_set)
    else:
        comm.allreduce_(buf, _engine_op(op))
        factor = postscale / comm.size if op == Average else postscale
        if factor != 1.0:
            scale_(buf, factor)
    return tensor if inplace else buf  # type: ignore[no-any-return]


def grouped_allreduce_start(tensors: Sequence[Any], inplace: bool, op: int, prescale: float,
                            postscale: float, process_set: ProcessSet, name: str | None) -> Pending:
    _adasum_set_first(op, process_set)
    comm = comm_of(process_set, "Allreduce")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise InvalidArgumentError("grouped ops take a non-empty list of tensors")
    for t in tensors:
        check_tensor(t)
    _check_names(comm, "grouped_allreduce", name)
    bufs = [_writable(t) for t in tensors] if inplace else [t.clone() for t in tensors]
    if prescale != 1.0:
        for b in bufs:
            scale_(b, prescale)
    if op == Adasum:
        _adasum(comm, bufs, process_set)
        factor = postscale
    else:
        comm.grouped_allreduce_(bufs, _engine_op(op))
        factor = postscale / comm.size if op == Average else postscale
    if factor != 1.0:
        for b in bufs:
            scale_(b, factor)
    return _done(list(tensors) if inplace else bufs)


def allgather_start(tensor: Any, process_set: ProcessSet, name: str | None) -> Pending:
    comm = comm_of(process_set, "Allgather")
    check_tensor(tensor, MOVE_DTYPES)
    if tensor.dim() == 0:
        raise ScalarInputError("allgather needs at least one dimension (it concatenates along dim 0); "
                               "reshape(1) the tensor first")
    _check_names(comm, "allgather", name)
    handle = comm.allgather_async(tensor)
    return Pending(handle, handle.wait, name)


def group_root(process_set: ProcessSet, root_rank: Any, comm: Any) -> int:
    """Horovod's roots are world ranks on every process set; the group's own rank of that root."""
    if isinstance(root_rank, bool) or not hasattr(root_rank, "__index__"):
        raise InvalidArgumentError(f"root_rank={root_rank!r} must be an int (a world rank)")
    root = int(root_rank.__index__())
    if process_set is global_process_set:
        if 0 <= root < comm.size:
            return root
    elif root in (process_set.ranks or ()):
        return (process_set.ranks or []).index(root)
    raise InvalidArgumentError(f"broadcast received invalid root rank {root} for provided process set")


def broadcast_start(tensor: Any, root_rank: Any, inplace: bool, process_set: ProcessSet,
                    name: str | None) -> Pending:
    comm = comm_of(process_set, "Broadcast")
    check_tensor(tensor, MOVE_DTYPES)
    root = group_root(process_set, root_rank, comm)
    _check_names(comm, "broadcast", name)
    buf = _writable(tensor) if inplace else tensor.clone()
    handle = comm.broadcast_async_(buf, root)
    out = tensor if inplace else buf
    return Pending(handle, lambda: out, name)


def _split_counts(tensor: torch.Tensor, splits: Any, n_ranks: int) -> list[int]:
    rows = tensor.shape[0]
    if splits is None:
        if rows % n_ranks:
            raise InvalidArgumentError("splits not provided, but first dimension of tensor is not an even "
                                       "multiple of the number of workers.")
        return [rows // n_ranks] * n_ranks
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise InvalidArgumentError("alltoall expects splits to contain 32-bit integer elements.")
        counts = [int(v) for v in splits.reshape(-1).tolist()]
    else:
        counts = [int(v) for v in splits]
    if len(counts) != n_ranks:
        raise InvalidArgumentError("Number of entries in splits does not equal number of workers.")
    if any(c < 0 for c in counts):
        raise InvalidArgumentError(f"alltoall splits {counts} must not be negative")
    if sum(counts) > rows:
        raise InvalidArgumentError("Sum of splits entries is greater than the first dimension of tensor.")
    return counts


def alltoall_start(tensor: Any, splits: Any, process_set: ProcessSet, name: str | None) -> Pending:
    """Runs at once; ``wait()`` gives (output, received_splits) with int32 splits, as Horovod's handle."""
    comm = comm_of(process_set, "Alltoall")
    check_tensor(tensor, MOVE_DTYPES)
    if tensor.dim() == 0:
        raise InvalidArgumentError("alltoall needs at least one dimension to split")
    counts = _split_counts(tensor, splits, comm.size)
    _check_names(comm, "alltoall", name)
    total = sum(counts)
    send = tensor if total == tensor.shape[0] else tensor[:total]
    output, received = comm.alltoall_splits(send, counts)  # the row counts travel with it: no exchange of our own
    device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")
    return _done((output, torch.tensor(received, dtype=torch.int32, device=device)))


def reducescatter_start(tensor: Any, op: int, prescale: float, postscale: float, process_set: ProcessSet,
                        name: str | None) -> Pending:
    comm = comm_of(process_set, "Reducescatter")
    check_tensor(tensor)
    if tensor.dim() == 0:
        raise InvalidArgumentError("Reducescatter does not support scalar inputs")
    if op not in (Average, Sum):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")
    _check_names(comm, "reducescatter", name)
    buf = tensor
    if prescale != 1.0:
        buf = scale_(tensor.clone(), prescale)
    handle = comm.reduce_scatter_async(buf, ReduceOp.SUM)
    factor = postscale / comm.size if op == Average else postscale
    if factor == 1.0:
        return Pending(handle, handle.wait, name)
    return Pending(handle, lambda: scale_(handle.wait(), factor), name)
