"""horovod.torch's own calls and DistributedOptimizer as Horovod's examples write them, for the benchmarks' raw
columns; its MPI controller under an MPI launcher (MPICH's algorithms), gloo under horovodrun --gloo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.registry import RawEngine


def _calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
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


def _grad_mean(mgr: Any) -> Callable[[Any], Any]:
    import horovod.torch as hvd

    return lambda g: hvd.allreduce_(g, op=hvd.Average)


def _optimizer(mgr: Any, model: Any, optimizer: Any) -> Any:
    """As Horovod's examples write it: rank 0's parameters and optimizer state broadcast, then
    ``hvd.DistributedOptimizer`` (its names prefixed so they never meet those of an optimizer unidist prepared in
    the same process)."""
    import horovod.torch as hvd

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return hvd.DistributedOptimizer(optimizer, named_parameters=[(f"native.{n}", p)
                                                                 for n, p in model.named_parameters()])


def _start() -> Callable[[], Any]:
    """Horovod as its scripts start it: ``hvd.init()`` under horovodrun."""
    import horovod.torch as hvd

    hvd.init()
    hvd.barrier()
    end: Callable[[], Any] = hvd.shutdown
    return end


RAW = RawEngine(
    api="horovod.torch",
    calls=_calls,
    grad_mean=_grad_mean,
    optimizer=_optimizer,
    reducer="hvd.DistributedOptimizer",
    start=_start,
    algorithms={"mpich": "mpich", "openmpi": "mpich", "*": "gloo"},
)
