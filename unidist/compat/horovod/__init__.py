"""``horovod.torch``'s API on every unidist backend: ``import unidist.compat.horovod as hvd``.

A Horovod script runs with only its import line changed, under ``python``, ``mpiexec``, ``torchrun``, the
``deepspeed`` launcher and ``horovodrun``: ``hvd.init()`` starts the Manager unidist selects there, and every
call below runs on its engine with Horovod's names, defaults and math (``op=Average`` by default, names,
handles, process sets, ``prescale_factor``/``postscale_factor``, Adasum). Where Horovod's behaviour cannot be
given, the call raises a typed error saying why; see the README, "Coming from Horovod".

Modules, one job each: ``basics`` (init, topology, build queries), ``process_sets``, ``ops`` (the
collectives and their handles), ``adasum`` (the Adasum reduction), ``compression``, ``functions``
(parameter, optimizer-state and object broadcasts), ``optimizer`` (DistributedOptimizer), ``elastic``.
"""

from __future__ import annotations

from unidist.compat import not_covered
from unidist.compat.horovod import elastic
from unidist.compat.horovod.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from unidist.compat.horovod.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from unidist.compat.horovod.compression import Compression
from unidist.compat.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from unidist.compat.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from unidist.compat.horovod.optimizer import DistributedOptimizer
from unidist.compat.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "HostsUpdatedInterrupt",
    "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline", "synchronize",
]

# a horovod.torch name this layer lacks: an AttributeError that says so and what to do instead
__getattr__ = not_covered("unidist.compat.horovod", "hvd", "docs/coming-from/horovod.md",
                          "Import horovod.torch itself for it (horovodrun runs it), or leave the call out.")
