"""mpi4py's own calls as its users write them (the buffer, uppercase API on the Manager's communicator: the
fastest ordinary form), for the benchmarks' raw columns, and MPICH's algorithms for the cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.registry import RawEngine


def _calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    from mpi4py import MPI

    comm, n = mgr.comm, mgr.size

    def allreduce(x: Any) -> Callable[[], Any]:
        a = x.numpy()
        return lambda: comm.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    def allgather(x: Any) -> Callable[[], Any]:
        a, out = x.numpy(), x.new_empty(n * x.numel()).numpy()
        return lambda: comm.Allgather(a, out)

    def broadcast(x: Any) -> Callable[[], Any]:
        a = x.numpy()
        return lambda: comm.Bcast(a, 0)

    def reduce_scatter(x: Any) -> Callable[[], Any]:
        a, out = x.numpy(), x.new_empty(x.numel() // n).numpy()
        return lambda: comm.Reduce_scatter_block(a, out, MPI.SUM)

    def alltoall(x: Any) -> Callable[[], Any]:
        a, out = x.numpy(), x.new_empty(x.shape).numpy()
        return lambda: comm.Alltoall(a, out)

    return {"allreduce": allreduce, "allgather": allgather, "broadcast": broadcast,
            "reduce_scatter": reduce_scatter, "alltoall": alltoall}


def _grad_mean(mgr: Any) -> Callable[[Any], None]:
    """MPI has no average op: sum, then divide, as hand-written loops do."""
    from mpi4py import MPI

    comm, n = mgr.comm, mgr.size

    def mean(g: Any) -> None:
        comm.Allreduce(MPI.IN_PLACE, g.numpy(), MPI.SUM)
        g.div_(n)
    return mean


def _p2p(mgr: Any) -> dict[str, tuple[Callable[[Any, int], Any], Callable[[Any, int], Any]]]:
    """mpi4py's blocking Send/Recv on the Manager's communicator, and Recv with the guard unidist's mpi backend
    adds: the receive status's count checked against the buffer's size."""
    from mpi4py import MPI

    comm, status = mgr.comm, MPI.Status()

    def send(t: Any, peer: int) -> None:
        comm.Send(t.numpy(), peer, 0)

    def recv(t: Any, peer: int) -> None:
        comm.Recv(t.numpy(), peer, 0)

    def counted(t: Any, peer: int) -> None:
        comm.Recv(t.numpy(), peer, 0, status)
        if status.Get_count(MPI.BYTE) != t.nbytes:
            raise AssertionError("the ping-pong's sizes differ")
    return {"engine": (send, recv), "engine+guard": (send, counted)}


def _start() -> Callable[[], None]:
    """mpi4py as its users start it: importing ``mpi4py.MPI`` initialises MPI (finalised at exit)."""
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # every rank up, as unidist's start leaves them
    return lambda: None


RAW = RawEngine(
    api="mpi4py",
    calls=_calls,
    grad_mean=_grad_mean,
    p2p=_p2p,
    start=_start,
    algorithms={"*": "mpich"},
)
