"""The engines' own calls, as their users write them: what unidist is compared against.

One table per backend maps a collective to a builder: given the input tensor unidist is timed on, it
allocates what the engine needs (output buffers, numpy views) once, outside the timing, and returns a
zero-argument call. Each call moves the same bytes as unidist's (see ``collectives.py`` for the sizes) and
uses the engine's fastest ordinary form: mpi4py's buffer (uppercase) calls on the manager's communicator,
``torch.distributed``'s tensor calls, ``deepspeed.comm``'s wrappers of them, ``horovod.torch``. The local
backend has no engine: its table is empty, so ``--compare`` prints no raw column there.

``grad_mean`` is the per-tensor gradient average a hand-written data-parallel loop would do with the engine
alone (the reference of ``gradsync``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ENGINE_NAMES", "OPS", "collective_table", "grad_mean"]

OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall")
ENGINE_NAMES = {"mpi": "mpi4py", "torch": "torch.distributed", "deepspeed": "deepspeed.comm",
                "horovod": "horovod.torch", "local": "none"}

Builder = Callable[[torch.Tensor], Callable[[], Any]]


def _mpi(mgr: Any) -> dict[str, Builder]:
    from mpi4py import MPI

    comm, n = mgr._comm, mgr.size

    def allreduce(x: torch.Tensor) -> Callable[[], Any]:
        a = x.numpy()
        return lambda: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    def allgather(x: torch.Tensor) -> Callable[[], Any]:
        a, out = x.numpy(), x.new_empty(n * x.numel()).numpy()
        return lambda: comm.Allgather(a, out)

    def broadcast(x: torch.Tensor) -> Callable[[], Any]:
        a = x.numpy()
        return lambda: comm.Bcast(a, 0)

    def reduce_scatter(x: torch.Tensor) -> Callable[[], Any]:
        a, out = x.numpy(), x.new_empty(x.numel() // n).numpy()
        return lambda: comm.Reduce_scatter_block(a, out, MPI.SUM)

    def alltoall(x: torch.Tensor) -> Callable[[], Any]:
        a, out = x.numpy(), torch.empty_like(x).numpy()
        return lambda: comm.Alltoall(a, out)

    return {"allreduce": allreduce, "allgather": allgather, "broadcast": broadcast,
            "reduce_scatter": reduce_scatter, "alltoall": alltoall}


def _torch_like(d: Any, n: int) -> dict[str, Builder]:
    """torch.distributed and deepspeed.comm spell these calls alike (default group, sum)."""

    def allreduce(x: torch.Tensor) -> Callable[[], Any]:
        return lambda: d.all_reduce(x)

    # torch >= 2.13 renamed the flat-tensor calls (the old names warn); deepspeed.comm keeps the old ones
    gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
    scatter = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor

    def allgather(x: torch.Tensor) -> Callable[[], Any]:
        out = x.new_empty(n * x.numel())
        return lambda: gather(out, x)

    def broadcast(x: torch.Tensor) -> Callable[[], Any]:
        return lambda: d.broadcast(x, 0)

    def reduce_scatter(x: torch.Tensor) -> Callable[[], Any]:
        out = x.new_empty(x.numel() // n)
        return lambda: scatter(out, x)

    def alltoall(x: torch.Tensor) -> Callable[[], Any]:
        out = torch.empty_like(x)
        return lambda: d.all_to_all_single(out, x)

    return {"allreduce": allreduce, "allgather": allgather, "broadcast": broadcast,
            "reduce_scatter": reduce_scatter, "alltoall": alltoall}


def _horovod(mgr: Any) -> dict[str, Builder]:
    import horovod.torch as hvd

    table: dict[str, Builder] = {
        "allreduce": lambda x: lambda: hvd.allreduce_(x, op=hvd.Sum),
        "allgather": lambda x: lambda: hvd.allgather(x),
        "broadcast": lambda x: lambda: hvd.broadcast_(x, root_rank=0),
        "alltoall": lambda x: lambda: hvd.alltoall(x),
    }
    if hasattr(hvd, "reducescatter"):  # Horovod >= 0.27
        table["reduce_scatter"] = lambda x: lambda: hvd.reducescatter(x, op=hvd.Sum)
    return table


def collective_table(mgr: Any) -> dict[str, Builder]:
    """The raw calls of ``mgr``'s engine by collective name; empty for the local backend."""
    backend = mgr.backend
    if backend == "mpi":
        return _mpi(mgr)
    if backend == "torch":
        import torch.distributed as dist

        return _torch_like(dist, mgr.size)
    if backend == "deepspeed":
        import deepspeed.comm as ds_comm

        return _torch_like(ds_comm, mgr.size)
    if backend == "horovod":
        return _horovod(mgr)
    return {}


def grad_mean(mgr: Any) -> Callable[[torch.Tensor], Any] | None:
    """The engine's in-place average of one gradient over the ranks (None on the local backend). MPI and
    torch have no average op: sum, then divide, as hand-written loops do; Horovod averages itself."""
    backend, n = mgr.backend, mgr.size
    if backend == "mpi":
        from mpi4py import MPI

        comm = mgr._comm

        def mpi_mean(g: torch.Tensor) -> None:
            comm.Allreduce(MPI.IN_PLACE, g.numpy(), MPI.SUM)
            g.div_(n)

        return mpi_mean
    if backend in ("torch", "deepspeed"):
        d: Any = importlib.import_module("torch.distributed" if backend == "torch" else "deepspeed.comm")

        def torch_mean(g: torch.Tensor) -> None:
            d.all_reduce(g)
            g.div_(n)

        return torch_mean
    if backend == "horovod":
        import horovod.torch as hvd

        return lambda g: hvd.allreduce_(g, op=hvd.Average)
    return None
