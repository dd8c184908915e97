"""The horovod backend: horovod.torch's collectives and its DistributedOptimizer behind prepare.

horovodrun's MPI mode does not recognise every MPI (the mpich wheel's hydra), so unidist starts it with
``--gloo``; under mpiexec, ``UNIDIST_BACKEND=horovod`` selects it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.registry import Backend, Launch, Strategy, register


def _manager() -> type[Any]:
    from unidist.engines.horovod.manager import HorovodManager

    return HorovodManager


def _strategy() -> Strategy:
    from unidist.engines.horovod.trainer import HorovodTrainer

    return HorovodTrainer


def _raw_calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    import horovod.torch as hvd

    table: dict[str, Callable[[Any], Callable[[], Any]]] = {
        "allreduce": lambda x: lambda: hvd.allreduce_(x, op=hvd.Sum),
        "allgather": lambda x: lambda: hvd.allgather(x),
        "broadcast": lambda x: lambda: hvd.broadcast_(x, root_rank=0),
        "alltoall": lambda x: lambda: hvd.alltoall(x),
    }
    if hasattr(hvd, "reducescatter"):  # Horovod >= 0.27
        table["reduce_scatter"] = lambda x: lambda: hvd.reducescatter(x, op=hvd.Sum)
    return table


def _raw_grad_mean(mgr: Any) -> Callable[[Any], Any]:
    import horovod.torch as hvd

    return lambda g: hvd.allreduce_(g, op=hvd.Average)


def _raw_optimizer(mgr: Any, model: Any, optimizer: Any) -> Any:
    """As Horovod's examples write it: rank 0's parameters and optimizer state broadcast, then
    ``hvd.DistributedOptimizer`` (its names prefixed so they never meet those of an optimizer unidist prepared in
    the same process)."""
    import horovod.torch as hvd

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return hvd.DistributedOptimizer(optimizer, named_parameters=[(f"native.{n}", p)
                                                                 for n, p in model.named_parameters()])


BACKEND = register(Backend(
    name="horovod",
    manager_name="HorovodManager",
    manager=_manager,
    strategy=_strategy,
    requires=("torch", "horovod"),
    install="build it with `bash launch_scripts/install_horovod.sh` (0.28.1 needs a patched build for torch >= 2.1)",
    launcher="horovodrun",
    implied_by=("horovodrun",),
    engine="horovod.torch",
    raw_calls=_raw_calls,
    raw_grad_mean=_raw_grad_mean,
    raw_optimizer=_raw_optimizer,
    engine_reducer="hvd.DistributedOptimizer",
    # its MPI controller under an MPI launcher (MPICH's algorithms, as the mpi backend); gloo under horovodrun --gloo
    algorithms={"mpich": "mpich", "openmpi": "mpich", "*": "gloo"},
    launches=(Launch("horovodrun", "horovodrun-gloo-{n}", (2,), bench="horovod-gloo"),
              Launch("mpich", "horovod-under-mpiexec-{n}", (2,), {"UNIDIST_BACKEND": "horovod"}, bench="horovod-mpi")),
))
