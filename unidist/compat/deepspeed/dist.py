"""``deepspeed.init_distributed`` on every unidist backend: the Manager, DeepSpeed's five variables, a
torch.distributed world.

DeepSpeed's ``init_distributed`` (ds/comm/comm.py:844-910) leaves a process with torch.distributed initialized
and RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in its environment; scripts rely on both (DSE cifar
reads ``os.environ["LOCAL_RANK"]`` and calls ``torch.distributed.get_rank()``/``barrier()``). Here:

- the Manager unidist selects is started (``state.manager()``): its launch detection replaces DeepSpeed's MPI
  discovery, so the ranks are the launcher's under python, mpiexec, torchrun, the deepspeed launcher, horovodrun;
- on the torch and deepspeed backends the Manager's own process group is the world (it initialized
  torch.distributed at start; the launcher or the Manager already exported the variables);
- on the local, mpi and horovod backends a gloo group is made here, on a store rank 0 serves; its address
  travels by the Manager's ``broadcast_object``. It is destroyed at exit before the Manager shuts down.

The variables, where the launcher did not set all five (DeepSpeed's condition for MPI discovery, comm.py:891):
RANK, WORLD_SIZE, LOCAL_RANK are the Manager's (DeepSpeed: mpi4py's rank, size, and the count of lower ranks
on the same processor name, comm.py:935-938: the same numbers). MASTER_PORT is ``distributed_port`` as in
DeepSpeed (comm.py:944) when that port is free on rank 0; when it is taken (another job, a parallel test)
DeepSpeed fails with "address already in use", here rank 0 takes a free port instead, logs a warning, and
MASTER_PORT is that port: the store really listens on MASTER_PORT either way. MASTER_ADDR is the address
rank 0 listens on: 127.0.0.1 when every rank is on one node, else rank 0's routable address
(``net.rendezvous_address``); DeepSpeed exports the first address of ``hostname -I`` (comm.py:922-929).
Where all five are set (torchrun, the deepspeed launcher, a user's export), they are used as they are. On the
torch backend under an MPI launcher the Manager's rendezvous already exported them (MASTER_PORT: the free port
it chose, not ``distributed_port``).

Differences from DeepSpeed, on purpose: ``auto_mpi_discovery`` changes nothing (unidist always knows the
ranks, also under horovodrun where DeepSpeed's mpi4py discovery would see singletons); ``config`` (comms
logging) is accepted and unused; ``dist_backend`` is gloo (or nccl with CUDA): ccl, mpi and hccl raise
DeepSpeedUnsupportedError. A second call is a no-op, as DeepSpeed's.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from datetime import timedelta
from typing import Any

import torch

from unidist.compat.deepspeed import state
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.errors import InvalidArgumentError, LaunchEnvironmentError, NotInitializedError

__all__ = ["DEFAULT_PG_TIMEOUT", "ENV_NAMES", "TORCH_DISTRIBUTED_DEFAULT_PORT", "init_distributed", "is_initialized",
           "shutdown"]

log = logging.getLogger("DeepSpeed")

ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # ds/comm/comm.py:890
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # ds/constants.py
DEFAULT_PG_TIMEOUT = timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", "10")))  # ds/constants.py:19
_DEEPSPEED_ONLY_BACKENDS = ("ccl", "mpi", "hccl")  # torch backends DeepSpeed's accelerators name (comm/constants.py)
_NOT_INITIALIZED = ("Distributed backend is not initialized. Please set dist_init_required to True or initialize "
                    "before calling deepspeed.initialize()")  # comm.py:885-887
_STORE_PREFIX = "unidist/ds_compat"


class _Run:
    """What ``init_distributed`` made: whether the compat world is up, and the group it owns (if any)."""

    __slots__ = ("initialized", "mgr", "owned", "store")

    def __init__(self) -> None:
        self.initialized = False  # deepspeed.comm's cdb: set by init_distributed, cleared by shutdown
        self.owned = False  # the torch.distributed world is ours (local/mpi/horovod backends)
        self.mgr: Any = None  # the Manager the world belongs to
        self.store: Any = None  # the store our group runs on (rank 0 hosts it)


_run = _Run()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta = DEFAULT_PG_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start unidist's Manager, export DeepSpeed's five variables and make torch.distributed initialized.

    Args (DeepSpeed's):
        dist_backend: ``"gloo"`` or, with CUDA, ``"nccl"``; None: the accelerator's (gloo on CPU, nccl on CUDA).
        auto_mpi_discovery: accepted; unidist detects the ranks of every launcher itself.
        distributed_port: MASTER_PORT where the launcher set none (a free port if this one is taken).
        verbose: log what was discovered (logger "DeepSpeed", INFO).
        timeout: the process group's timeout (DeepSpeed's default: DEEPSPEED_TIMEOUT minutes, 10).
        init_method: a torch ``init_method`` URL for the group made here (instead of unidist's store).
        dist_init_required: False: torch.distributed must already be initialized (else NotInitializedError).
        config: accepted (DeepSpeed reads comms-logging options from it); unused.
        rank, world_size: with ``init_method``; must be the launcher's when given.
    """
    backend = _check_backend(dist_backend)
    if not isinstance(timeout, timedelta):
        raise InvalidArgumentError(f"init_distributed(timeout=) must be a datetime.timedelta, not "
                                   f"{type(timeout).__name__} (DeepSpeed asserts the same, comm.py:899)")
    mgr = state.manager()
    for name, given, have in (("rank", rank, mgr.rank), ("world_size", world_size, mgr.size)):
        if given >= 0 and given != have:
            raise InvalidArgumentError(f"init_distributed({name}={given}) but the launcher started this process as "
                                       f"{name} {have}; leave it at -1")
    if _run.owned and _run.mgr is not mgr:  # our world belongs to a Manager that has shut down
        shutdown()
    dist = torch.distributed
    if dist_init_required is False and not dist.is_initialized():
        raise NotInitializedError(_NOT_INITIALIZED)
    if dist.is_initialized():
        _export_known(mgr)
        if (dist.get_rank(), dist.get_world_size()) != (mgr.rank, mgr.size):
            raise LaunchEnvironmentError(
                f"torch.distributed is initialized as rank {dist.get_rank()} of {dist.get_world_size()}, but the "
                f"{mgr.launch.launcher} launcher started rank {mgr.rank} of {mgr.size}; initialize it with the "
                "launcher's ranks, or let init_distributed do it")
    else:
        _make_world(mgr, backend, distributed_port, timeout, init_method)
    _run.initialized, _run.mgr = True, mgr
    if verbose and mgr.rank == 0:
        log.info("init_distributed: rank %s of %s (local rank %s) on the %s backend, MASTER_ADDR=%s MASTER_PORT=%s",
                 *(os.environ.get(n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK")), mgr.backend,
                 os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))


def is_initialized() -> bool:
    """Whether ``init_distributed`` made the world and it is still up (``deepspeed.comm.is_initialized``)."""
    return _run.initialized and torch.distributed.is_initialized()


def shutdown() -> None:
    """End the compat world: destroy the group made here (after a meeting of the ranks, rank 0 last, since it
    hosts the store); a world the Manager owns (torch, deepspeed backends) stays for the Manager to end."""
    owned, store, mgr = _run.owned, _run.store, _run.mgr
    _run.initialized = _run.owned = False
    _run.store = _run.mgr = None
    dist = torch.distributed
    if not owned or not dist.is_initialized():
        return
    size, rank = dist.get_world_size(), dist.get_rank()
    if store is None or size == 1:
        dist.destroy_process_group()
        return
    from unidist.managers import stores

    if mgr is not None and mgr.started:
        mgr.barrier()  # a rank destroying gloo pairs a peer still uses aborts that peer (engines/torch/manager.py:258)
    stores.leave_in_order(store, rank, size, mgr.config.timeout if mgr is not None else 60.0,
                          dist.destroy_process_group)


def _check_backend(dist_backend: str | None) -> str:
    """The torch backend string for a group made here."""
    cuda = torch.cuda.is_available()
    if dist_backend is None:
        from unidist.compat.deepspeed.accelerator import get_accelerator

        dist_backend = get_accelerator().communication_backend_name()
    if dist_backend in _DEEPSPEED_ONLY_BACKENDS:
        raise DeepSpeedUnsupportedError(
            f"init_distributed(dist_backend={dist_backend!r}) needs DeepSpeed's own communication backend; use "
            "'gloo' (or 'nccl' with CUDA), or run under the deepspeed launcher with real deepspeed")
    if dist_backend == "gloo":
        return "gloo"
    if dist_backend == "nccl" and cuda:
        return "cpu:gloo,cuda:nccl"  # gpu-untested: nccl for CUDA tensors, gloo for unidist's CPU control tensors
    raise InvalidArgumentError(
        f"init_distributed(dist_backend={dist_backend!r}): use 'gloo'" + (" or 'nccl'" if cuda else
                                                                          " ('nccl' needs CUDA, and torch sees none)"))


def _setenv_missing(values: dict[str, str]) -> None:
    for name, value in values.items():
        os.environ.setdefault(name, value)


def _export_known(mgr: Any) -> None:
    """A world someone else made (the Manager, the user): the launcher's ranks where a variable is missing.
    DeepSpeed exports nothing in this case (comm.py:874-877); the script still finds its LOCAL_RANK."""
    _setenv_missing({"RANK": str(mgr.rank), "WORLD_SIZE": str(mgr.size), "LOCAL_RANK": str(mgr.local_rank)})


def _make_world(mgr: Any, backend: str, port: int, timeout: timedelta, init_method: str | None) -> None:
    """The gloo world of the local, mpi and horovod backends, on a store rank 0 serves."""
    from unidist.managers import stores

    dist: Any = torch.distributed  # PrefixStore: not in its typed exports
    given = all(n in os.environ for n in ENV_NAMES)  # DeepSpeed skips discovery then (comm.py:891)
    sock = None
    if mgr.rank == 0:
        sock, address = _rank0_address(mgr, port, given, listen=init_method is None)
    else:
        address = None
    address = mgr.broadcast_object(address, 0)
    if address[0] == "error":  # rank 0 could not listen: every rank raises, none waits for its store
        raise LaunchEnvironmentError(address[1])
    host, master_port = address
    if not given:
        os.environ.update({"RANK": str(mgr.rank), "WORLD_SIZE": str(mgr.size), "LOCAL_RANK": str(mgr.local_rank),
                           "MASTER_ADDR": str(host), "MASTER_PORT": str(master_port)})
    if init_method is not None:
        dist.init_process_group(backend, init_method=init_method, rank=mgr.rank, world_size=mgr.size, timeout=timeout)
        _own(mgr, None)
        return
    store = stores.serve(sock, mgr.size, timeout) if sock is not None else \
        stores.connect(host, master_port, mgr.size, timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(_STORE_PREFIX, store), rank=mgr.rank,
                            world_size=mgr.size, timeout=timeout)
    _own(mgr, store)


def _rank0_address(mgr: Any, port: int, given: bool, listen: bool) -> tuple[Any, tuple[Any, ...]]:
    """Rank 0's listening socket (None without ``listen``) and the (host, port) its peers connect to, or
    ``(None, ("error", message))``."""
    from unidist.net import listener, rendezvous_address

    if given:
        host, want = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        host, want = rendezvous_address(mgr.local_size == mgr.size), port
    if not listen:
        return None, (host, want)
    try:
        sock = listener(host, want, fallback_any=given)
    except OSError as err:
        if given or want == 0:
            return None, ("error", f"rank 0 cannot listen on MASTER_ADDR={host} MASTER_PORT={want} ({err.strerror});"
                                   " set them to an address of rank 0's host and a port free on it")
        log.warning("init_distributed: distributed_port %d is taken on %s (%s); MASTER_PORT is a free port instead",
                    want, host, err.strerror)
        sock = listener(host, 0)
    return sock, (host if given else sock.getsockname()[0], sock.getsockname()[1])


def _own(mgr: Any, store: Any) -> None:
    _run.owned, _run.mgr, _run.store = True, mgr, store
    # atexit runs last-registered first: re-registering puts this ahead of the Manager's shutdown (state.py)
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _at_exit() -> None:
    """``shutdown`` at exit; after an uncaught exception (``sys.last_value``) the group is left as it is: the
    peers may wait in a collective and never reach the meeting, and the Manager's exit ends the job."""
    if getattr(sys, "last_value", None) is not None:
        _run.initialized = _run.owned = False
        _run.store = _run.mgr = None
        return
    shutdown()
