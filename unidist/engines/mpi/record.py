"""The mpi backend (mpi4py): its registration (its own calls for the benchmarks are raw.py's)."""

from __future__ import annotations

from typing import Any

from unidist.engines.mpi.raw import RAW
from unidist.engines.training import unidist_training
from unidist.launch import LAUNCHERS
from unidist.registry import Backend, Launch, register


def _manager() -> type[Any]:
    from unidist.engines.mpi.manager import MPIManager

    return MPIManager


BACKEND = register(Backend(
    name="mpi",
    manager_name="MPIManager",
    manager=_manager,
    strategy=unidist_training,
    requires=("torch", "mpi4py"),
    install="from the unidist clone: pip install -c constraints.txt '.[mpi]' (mpi4py and the mpich wheel, which "
            "provides mpiexec; on a cluster, build mpi4py against its MPI)",
    launcher="mpich",
    implied_by=tuple(fam.name for fam in LAUNCHERS if fam.mpi_like),
    needs_pmi=True,
    distributions=("mpich",),
    raw=RAW,
    launches=(Launch("mpich", "mpiexec-{n}", (2, 3), bench="mpi"),
              Launch("mpich", "mpiexec-{n}-checked", (2,), {"UNIDIST_CHECK_COLLECTIVES": "1"})),
))
