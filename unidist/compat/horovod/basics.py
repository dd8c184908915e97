"""``hvd.init``, topology and the build queries: Horovod's basics over the Manager unidist selects.

``init()`` starts ``unidist.init()`` (so the same script runs under python, mpiexec, torchrun, the deepspeed
launcher and horovodrun) and exchanges every rank's (node, local rank) once, from which Horovod's cross ranks
and homogeneity follow. As in Horovod, a second ``init()`` is a no-op, ``shutdown()`` then ``init()`` starts
again, an atexit hook shuts down, and every topology call before ``init()`` raises
``ValueError('Horovod has not been initialized; use hvd.init().')`` (here a ``HorovodNotInitializedError``,
which is also unidist's ``NotInitializedError``).

Build queries answer for the engine in use (``mpi_built`` etc. describe what this run can do, not what some
other install could):

=================  ===========  ===========  ===================  ===================  =====================
query              local        mpi          torch / deepspeed    horovod              type
=================  ===========  ===========  ===================  ===================  =====================
mpi_built          False        True         False                Horovod's answer     bool
mpi_enabled        False        True         False                Horovod's answer     bool
gloo_built         False        False        gloo available       Horovod's answer     bool
gloo_enabled       False        False        group uses gloo      Horovod's answer     bool
nccl_built         0            0            NCCL version code    Horovod's answer     int (0 = not built)
                                             if CUDA + NCCL
cuda_built         CUDA usable  CUDA usable  CUDA usable          Horovod's answer     bool
rocm_built         ROCm usable  ROCm usable  ROCm usable          Horovod's answer     bool
ddl_built          False        False        False                Horovod's answer     bool
ccl_built          False        False        False                Horovod's answer     bool
mpi_threads_sup.   ValueError   MPI thread   ValueError           Horovod's answer     bool
                                level is
                                MULTIPLE
=================  ===========  ===========  ===================  ===================  =====================

"CUDA usable" is ``torch.cuda.is_available()`` with a CUDA build of torch: every unidist engine moves CUDA
tensors (staging through the host where the engine cannot). The build queries work before ``init()`` too
(Horovod's do); before it they describe the backend unidist would select.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

import torch

import unidist
from unidist.compat.horovod import handles
from unidist.compat.horovod import process_sets as ps_mod
from unidist.compat.horovod.state import HorovodNotInitializedError, UnsupportedFeatureError, manager, state
from unidist.errors import InvalidArgumentError, NotInitializedError

__all__ = [
    "HorovodNotInitializedError", "UnsupportedFeatureError", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init", "is_homogeneous", "is_initialized",
    "local_rank", "local_size", "manager", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "rank", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]

def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start the Manager unidist selects for this launch (no-op when already initialized, as in Horovod).

    Inside a ``with unidist.init() as mgr:`` block, ``hvd`` uses that Manager (and ``hvd.shutdown()`` leaves
    it to the block), so unidist and Horovod calls mix in one script.

    Args:
        comm: Horovod's MPI communicator choice. Only None, a list naming every rank in order, or an mpi4py
            communicator spanning the world (``MPI.COMM_WORLD`` under mpiexec) are possible here: unidist's world
            is the launch. Anything else is an UnsupportedFeatureError.
        process_sets: None, a list of ``hvd.ProcessSet`` to register now (every rank passes the same list),
            or "dynamic" (Horovod's switch that allows ``add_process_set`` later; sets
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` as Horovod does).
    """
    if state.mgr is not None and state.mgr.started:
        return
    if state.mgr is not None:  # a `with unidist.init()` block's Manager, since ended: forget its sets and handles
        handles.reset()
        ps_mod.reset()
        state.mgr = None
    mpi_comm = _is_mpi_comm(comm)
    if comm is not None and not mpi_comm and not isinstance(comm, (list, tuple, range)):
        raise UnsupportedFeatureError(
            f"hvd.init(comm={comm!r}) takes None, a list of every rank, or an mpi4py communicator spanning the "
            "world; use hvd.ProcessSet / hvd.add_process_set for a subset of ranks.")
    listed = ps_mod.prepare_init_sets(process_sets)
    mgr = _running()
    state.owned = mgr is None
    if mgr is None:
        dynamic = os.environ.get(ps_mod.DYNAMIC)
        mgr = unidist.init().start()
        if dynamic is None:  # the horovod backend's own init sets it; the user's choice is what counts here
            os.environ.pop(ps_mod.DYNAMIC, None)
    state.mgr = mgr
    try:
        _check_comm(mgr, comm, mpi_comm)
        _topology(mgr)
    except BaseException:
        _stop()
        raise
    if not state.atexit_registered:
        atexit.register(_at_exit)
        state.atexit_registered = True
    handles.reset()
    ps_mod.register_init_sets(mgr, listed)


def _is_mpi_comm(comm: Any) -> bool:
    return comm is not None and type(comm).__module__.startswith("mpi4py")


def _check_comm(mgr: Any, comm: Any, mpi_comm: bool) -> None:
    """Horovod's ``comm``: unidist's world is every launched process, so only a comm naming all of them, in
    order, is possible (a list of ranks, or an mpi4py communicator such as ``MPI.COMM_WORLD``)."""
    if comm is None:
        return
    if mpi_comm:
        mine = comm.Get_size() == mgr.size and comm.Get_rank() == mgr.rank
        if all(mgr.allgather_object(mine)) if mgr.size > 1 else mine:
            return
        what = f"an mpi4py communicator of {comm.Get_size()} ranks that is not the world"
    elif [int(r) for r in comm] == list(range(mgr.size)):
        return
    else:
        what = f"the ranks {list(comm)}"
    raise UnsupportedFeatureError(
        f"hvd.init(comm=...) got {what}; unidist's world is every one of the {mgr.size} launched processes. Call "
        "hvd.init() and use hvd.ProcessSet / hvd.add_process_set for a subset of ranks.")


def _topology(mgr: Any) -> None:
    """Cross rank/size and homogeneity from every rank's (node, local rank): one object allgather."""
    table = mgr.allgather_object((mgr.node_rank, mgr.local_rank)) if mgr.size > 1 else [(0, 0)]
    mine = table[mgr.rank]
    same_local = sorted(node for node, local in table if local == mine[1])
    state.cross = (same_local.index(mine[0]), len(same_local))
    per_node: dict[int, int] = {}
    for node, _ in table:
        per_node[node] = per_node.get(node, 0) + 1
    state.homogeneous = len(set(per_node.values())) == 1


def _running() -> Any:
    """The Manager a ``with unidist.init()`` block started in this process, if any."""
    from unidist.managers.base import get_manager

    try:
        return get_manager()
    except NotInitializedError:
        return None


def _stop() -> None:
    mgr, state.mgr = state.mgr, None
    if mgr is not None and state.owned:
        mgr.shutdown()


def _at_exit() -> None:
    """Horovod shuts down at exit. After an uncaught exception (``sys.last_value``) this rank leaves as a
    failed ``with unidist.init()`` block does: it ends the job where the engine can, without the leaving
    barrier its peers (waiting in some collective) would never reach."""
    mgr = state.mgr
    if mgr is None or not mgr.started:
        return
    exc = getattr(sys, "last_value", None)
    if exc is None or not state.owned:
        shutdown()
        return
    handles.reset()
    ps_mod.reset()
    state.mgr = None
    mgr.__exit__(type(exc), exc, exc.__traceback__)


def shutdown() -> None:
    """Shut the Manager down (a no-op when not initialized); ``init()`` may start a new run afterwards."""
    handles.reset()
    ps_mod.reset()
    _stop()


def is_initialized() -> bool:
    return state.mgr is not None and state.mgr.started


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline is not recorded yet (a later change adds one): a no-op that still requires
    ``init()`` and a path, as Horovod does."""
    manager()
    if not isinstance(file_path, str):
        raise InvalidArgumentError(f"start_timeline(file_path={file_path!r}) takes a path string")


def stop_timeline() -> None:
    """No-op counterpart of ``start_timeline``; requires ``init()``."""
    manager()


def size() -> int:
    return int(manager().size)


def rank() -> int:
    return int(manager().rank)


def local_size() -> int:
    return int(manager().local_size)


def local_rank() -> int:
    return int(manager().local_rank)


def cross_size() -> int:
    """Number of processes with this process's local rank (one per node that has it)."""
    manager()
    return state.cross[1]


def cross_rank() -> int:
    """This process's index among the processes with its local rank: its node's, counted over those nodes."""
    manager()
    return state.cross[0]


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    manager()
    return state.homogeneous


# ------------------------------------------------------------------------------------------ build queries
def _backend() -> str:
    """The backend in use, or the one unidist would select before init."""
    mgr = state.mgr
    if mgr is not None and mgr.started:
        return str(mgr.backend)
    return str(unidist.init().backend)


def _real_horovod() -> Any:
    import horovod.torch as real

    return real


def _cuda() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available()


def _torch_like(backend: str) -> bool:
    return backend in ("torch", "deepspeed")


def mpi_built() -> bool:
    backend = _backend()
    return bool(_real_horovod().mpi_built()) if backend == "horovod" else backend == "mpi"


def mpi_enabled() -> bool:
    backend = _backend()
    return bool(_real_horovod().mpi_enabled()) if backend == "horovod" else backend == "mpi"


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE; a ValueError where MPI is not in use, as in Horovod."""
    backend = _backend()
    if backend == "horovod":
        return bool(_real_horovod().mpi_threads_supported())
    if backend != "mpi":
        raise UnsupportedFeatureError("Horovod MPI is not enabled; Please make sure it's installed and enabled.")
    manager()
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def gloo_built() -> bool:
    backend = _backend()
    if backend == "horovod":
        return bool(_real_horovod().gloo_built())
    if _torch_like(backend):
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_gloo_available())
    return False


def gloo_enabled() -> bool:
    backend = _backend()
    if backend == "horovod":
        return bool(_real_horovod().gloo_enabled())
    if _torch_like(backend) and is_initialized():
        import torch.distributed as dist

        return dist.is_initialized() and "gloo" in str(dist.get_backend())
    return False


def nccl_built() -> int:
    """Horovod's int: the NCCL version code (major*10000 + minor*100 + patch) when NCCL can be used, else 0."""
    backend = _backend()
    if backend == "horovod":
        return int(_real_horovod().nccl_built())
    if _torch_like(backend) and _cuda():
        import torch.distributed as dist

        if dist.is_available() and dist.is_nccl_available():
            major, minor, patch = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            return int(major * 10000 + minor * 100 + patch)
    return 0


def cuda_built() -> bool:
    return bool(_real_horovod().cuda_built()) if _backend() == "horovod" else _cuda()


def rocm_built() -> bool:
    if _backend() == "horovod":
        return bool(_real_horovod().rocm_built())
    return torch.version.hip is not None and torch.cuda.is_available()


def ddl_built() -> bool:
    return bool(_real_horovod().ddl_built()) if _backend() == "horovod" else False


def ccl_built() -> bool:
    return bool(_real_horovod().ccl_built()) if _backend() == "horovod" else False
