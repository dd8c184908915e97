"""The horovod backend: horovod.torch's collectives and its DistributedOptimizer behind prepare.

horovodrun's MPI mode does not recognise every MPI (the mpich wheel's hydra), so unidist starts it with
``--gloo``; under mpiexec, ``UNIDIST_BACKEND=horovod`` selects it.
"""

from __future__ import annotations

from typing import Any

from unidist.engines.horovod.raw import RAW
from unidist.registry import Backend, Launch, Strategy, register


def _manager() -> type[Any]:
    from unidist.engines.horovod.manager import HorovodManager

    return HorovodManager


def _strategy() -> Strategy:
    from unidist.engines.horovod.trainer import HorovodTrainer

    return HorovodTrainer


BACKEND = register(Backend(
    name="horovod",
    manager_name="HorovodManager",
    manager=_manager,
    strategy=_strategy,
    requires=("torch", "horovod"),
    install="build it with `bash launch_scripts/install_horovod.sh` (0.28.1 needs a patched build for torch >= 2.1)",
    launcher="horovodrun",
    implied_by=("horovodrun",),
    raw=RAW,
    launches=(Launch("horovodrun", "horovodrun-gloo-{n}", (2,), bench="horovod-gloo"),
              Launch("mpich", "horovod-under-mpiexec-{n}", (2,), {"UNIDIST_BACKEND": "horovod"}, bench="horovod-mpi")),
))
