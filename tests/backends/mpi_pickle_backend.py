"""A backend written outside unidist, in this one file: the proof that adding an engine needs no edit under
``unidist/`` (issue 19). Its engine is mpi4py's *pickle* (lowercase) API — another engine's primitives than
unidist's mpi backend, which moves buffers with the uppercase calls — and reductions are computed with numpy
on every rank's contribution in rank order, so every rank gets the same bits.

It registers itself on import with one call, ``unidist.registry.register``; the test tree declares it as a
``unidist.backends`` entry point (``unidist_test_backends-0.dist-info`` beside this file), so a script run
with ``UNIDIST_BACKEND=mpi_pickle`` under ``mpiexec`` selects it without importing it. The test suites pick
it up from its record (tests/helpers.py reads every record's launches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from unidist.comm.engine import Engine
from unidist.engines import unidist_training
from unidist.errors import CollectiveMismatchError
from unidist.managers.base import Manager
from unidist.ops import ReduceOp
from unidist.registry import Backend, Launch, register

NAME = "mpi_pickle"
_REDUCE: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add.reduce, ReduceOp.PRODUCT: np.multiply.reduce,
    ReduceOp.MIN: np.minimum.reduce, ReduceOp.MAX: np.maximum.reduce,
}


def _np(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return t.detach().reshape(-1).numpy()


class PickleEngine(Engine):
    """Primitives on ``comm.allgather``/``alltoall``/``bcast``/``send``/``recv`` of numpy arrays."""

    # numpy has no bfloat16: move its bits as int16, reduce it (and float16, as MPI does) in float32
    upcast_reduce: ClassVar[dict[torch.dtype, torch.dtype]] = {torch.float16: torch.float32,
                                                                torch.bfloat16: torch.float32}
    wire_dtypes: ClassVar[dict[torch.dtype, torch.dtype]] = {torch.bfloat16: torch.int16}
    aborts_job = True

    def __init__(self, comm: Any, mpi: Any) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.comm, self.mpi = comm, mpi
        self._subs: list[Any] = []

    def barrier(self) -> None:
        self.comm.barrier()

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        got = self.comm.bcast(_np(t) if self.rank == root else None, root=root)
        if self.rank != root:
            _np(t)[:] = got

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        parts = self.comm.allgather(_np(send))
        _np(recv)[:] = _REDUCE[op](np.stack(parts), axis=0, dtype=parts[0].dtype)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        _np(recv)[:] = np.concatenate(self.comm.allgather(_np(send)))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                 recv_counts: Sequence[int]) -> None:
        cuts = np.cumsum(send_counts)[:-1]
        got = self.comm.alltoall(np.split(_np(send), cuts))
        if recv.numel():
            _np(recv)[:] = np.concatenate(got)

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self.comm.send(_np(t).copy(), dest=dest, tag=tag)

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        got = self.comm.recv(source=source, tag=tag)
        if got.size != t.numel() or got.dtype != _np(t).dtype:
            raise CollectiveMismatchError(f"recv: the message from rank {source} is {got.size} x {got.dtype}, the "
                                          f"buffer {t.numel()} x {_np(t).dtype}")
        _np(t)[:] = got

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        mine = next((i for i, ranks in enumerate(lists) if self.rank in ranks), None)
        sub = self.comm.Split(self.mpi.UNDEFINED if mine is None else mine,
                              0 if mine is None else lists[mine].index(self.rank))
        out: list[Engine | None] = [None] * len(lists)
        if mine is not None:
            self._subs.append(sub)
            out[mine] = PickleEngine(sub, self.mpi)
        return out

    def abort(self, code: int) -> None:
        self.mpi.COMM_WORLD.Abort(code)

    def close(self) -> None:
        for sub in self._subs:
            sub.Free()
        self.comm.Free()


class PickleMPIManager(Manager):
    """Start-up and shutdown: a duplicate of COMM_WORLD; local ranks from the shared-memory split (one node)."""

    name = NAME

    def _start(self) -> Engine:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        self._local_rank, self._local_size = node.Get_rank(), node.Get_size()
        self._node_rank = comm.Get_rank() // node.Get_size()  # equal ranks per node, as mpiexec places them
        node.Free()
        return PickleEngine(comm, MPI)

    def _shutdown(self) -> None:
        self._engine.close()


BACKEND = register(Backend(
    name=NAME,
    manager_name="PickleMPIManager",
    manager=lambda: PickleMPIManager,
    strategy=unidist_training,
    requires=("mpi4py",),
    install="pip install mpi4py mpich",
    launcher="mpich",
    needs_pmi=True,
    launches=(Launch("mpich", f"{NAME}-{{n}}", (2,), {"UNIDIST_BACKEND": NAME}),),
))
