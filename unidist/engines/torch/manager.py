"""TorchManager on torch.distributed: gloo on CPU, nccl on CUDA.

Also the base of DeepSpeedManager, whose ``deepspeed.comm`` mirrors this API: the engine module is
``self._dist`` and only start-up differs. Rendezvous follows ``env://`` (MASTER_ADDR, MASTER_PORT); under
``mpiexec`` rank 0's address and port are shared through mpi4py when it is installed, so none is needed there.
Rank 0 hosts the store on a socket bound to that address alone (loopback for a single-node job), not on every
interface as torch's own env:// store does; torchrun's agent hosts its own.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NoReturn

import torch

from unidist.comm import watchdog
from unidist.comm.engine import Engine, SortedOrder
from unidist.comm.mismatch import Framing, Verdicts
from unidist.comm.work import EngineWork, Work
from unidist.errors import BackendUnavailableError, LaunchEnvironmentError
from unidist.launch import family
from unidist.managers import stores
from unidist.managers.base import Manager
from unidist.net import listener, rendezvous_address
from unidist.ops import ReduceOp

__all__ = ["SHARED_GPU_WARNING", "HostStagedTorchEngine", "TorchEngine", "TorchManager", "shares_gpus",
           "store_listener"]

_log = logging.getLogger("unidist")


def _work(work: Any, *keep: object) -> Work:
    return EngineWork(work.wait, work.is_completed, *keep)


class TorchEngine(SortedOrder, Engine):
    """torch.distributed (or deepspeed.comm) primitives over one process group: ``_pg`` None is the world.

    Both APIs name peers and roots by world rank, also inside a group (``_world`` translates), and order a
    group's members by world rank (``SortedOrder`` permutes chunks for groups ordered otherwise).
    """

    # gloo and nccl have no int16 arithmetic or transport: reduce in int32, move the raw bits as float16
    upcast_reduce: ClassVar[Mapping[torch.dtype, torch.dtype]] = {torch.int16: torch.int32}
    # a gradient from 4 MiB up is reduced in its own storage (one gloo call, ~0.3 ms) rather than copied into a
    # bucket: gradient sync / raw per-tensor on 2 ranks, gloo, this 2-core machine: GPT-2 shapes 1.03 all copied,
    # 0.87 from 16 MiB, 0.78 from 4 MiB, 0.88 from 1 MiB; ResNet-50 0.67, 0.60 from 4 MiB, 0.65 from 1 MiB
    reduce_alone_from: ClassVar[float] = float(4 << 20)
    wire_dtypes: ClassVar[Mapping[torch.dtype, torch.dtype]] = {torch.int16: torch.float16}

    def __init__(self, dist: Any, rank: int, size: int, pg: Any = None, members: Sequence[int] | None = None,
                 verdicts: Verdicts | None = None) -> None:
        super().__init__(rank, size)
        self._dist, self._pg = dist, pg
        self._members = None if members is None else tuple(members)  # world ranks in group order; None: the world
        if members is not None:
            self._set_order(members)  # torch numbers a group's members by world rank, whatever order they came in
        # torch >= 2.10 renamed the *_tensor calls *_single and warns on the old names, which deepspeed.comm
        # still calls: take them from torch.distributed itself (the same default group under DeepSpeed).
        import torch.distributed as tdist

        self._gather_into = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
        self._reduce_scatter_into = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
        ops = tdist.ReduceOp  # deepspeed.comm takes torch's ops too
        self._ops = {ReduceOp.SUM: ops.SUM, ReduceOp.MIN: ops.MIN, ReduceOp.MAX: ops.MAX,
                     ReduceOp.PRODUCT: ops.PRODUCT}
        self._framing = Framing(self._raw_send, self._raw_recv, rank=self.rank, world=self._world, verdicts=verdicts)

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        """``new_group`` for each list, on every rank in the same order (the engine requires both)."""
        out: list[Engine | None] = []
        for ranks in lists:
            pg = self._dist.new_group(ranks)
            me = self._world(self.rank)
            out.append(type(self)(self._dist, ranks.index(me), len(ranks), pg, [self._world(r) for r in ranks],
                                  self._framing.verdicts) if me in ranks else None)
        return out

    def _world(self, rank: int) -> int:
        return rank if self._members is None else self._members[rank]

    def barrier(self) -> None:
        self._dist.barrier(group=self._pg)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self._dist.broadcast(t, self._world(root), group=self._pg)

    def broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        return _work(self._dist.broadcast(t, self._world(root), group=self._pg, async_op=True), t)

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        if send is not recv:
            recv.copy_(send)
        self._dist.all_reduce(recv, self._ops[op], group=self._pg)

    def reduce(self, send: torch.Tensor, recv: torch.Tensor, root: int, op: ReduceOp) -> None:
        if send is not recv:
            recv.copy_(send)
        self._dist.reduce(recv, self._world(root), self._ops[op], group=self._pg)

    def allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        if send is not recv:
            recv.copy_(send)
        return _work(self._dist.all_reduce(recv, self._ops[op], group=self._pg, async_op=True), send, recv)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        self.allgather_async(send, recv, counts).wait()

    def allgather_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Work:
        width = max(counts) if counts else 0
        flat_send, flat_recv = send.reshape(-1), recv.view(-1)
        if all(c == width for c in counts) and self._perm is None:
            return _work(self._gather_into(flat_recv, flat_send, group=self._pg, async_op=True), send, recv)
        # engines need equal sizes: pad every rank's part to the widest, then drop the padding (and put the
        # parts in group order: the engine's is by world rank)
        padded = flat_send.new_zeros(width)
        padded[: flat_send.numel()] = flat_send
        staging = flat_send.new_empty(width * self.size)
        self._gather_into(staging, padded, group=self._pg)
        staging = self._from_engine_order(staging, [width] * self.size)
        offset = 0
        for rank, count in enumerate(counts):
            flat_recv[offset:offset + count] = staging[rank * width:rank * width + count]
            offset += count
        return EngineWork(lambda: None, lambda: True, send, recv)  # done; kept like an engine's handle

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        if self._perm is None:
            self._dist.all_to_all_single(recv.view(-1), send.reshape(-1), list(recv_counts), list(send_counts),
                                         group=self._pg)
            return
        staging = recv.new_empty(recv.numel()).view(-1)
        self._dist.all_to_all_single(staging, self._to_engine_order(send.reshape(-1), send_counts),
                                     self._permuted(recv_counts), self._permuted(send_counts), group=self._pg)
        recv.view(-1).copy_(self._from_engine_order(staging, recv_counts))

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                        op: ReduceOp) -> None:
        if all(c == counts[0] for c in counts):
            flat = self._to_engine_order(send.reshape(-1), counts)
            self._reduce_scatter_into(recv.view(-1), flat, self._ops[op], group=self._pg)
        else:
            super().reduce_scatter(send, recv, counts, op)

    def reduce_scatter_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                              op: ReduceOp) -> Work:
        if not all(c == counts[0] for c in counts):
            return super().reduce_scatter_async(send, recv, counts, op)
        flat = self._to_engine_order(send.reshape(-1), counts)
        return _work(self._reduce_scatter_into(recv.view(-1), flat, self._ops[op], group=self._pg, async_op=True),
                     send, flat, recv)

    # every message framed with its dtype and size (comm/mismatch.py): gloo accepts a shorter message silently
    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._framing.send(t, dest, tag)

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self._framing.recv(t, source, tag)

    def pending_mismatch(self) -> Exception | None:
        return self._framing.pending()

    def _raw_send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._dist.send(t, self._world(dest), group=self._pg, tag=tag)

    def _raw_recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self._dist.recv(t, self._world(source), group=self._pg, tag=tag)


class HostStagedTorchEngine(TorchEngine):
    """TorchEngine over a gloo-only group on a GPU host whose ranks share GPUs: NCCL refuses two ranks on one
    device ("Duplicate GPU detected"), so each collective's CUDA tensors are copied to pinned host memory (a
    blocking copy: it waits for the stream that produced them), moved by gloo, and copied back. Asynchronous calls
    complete before they return. CPU tensors go straight through."""

    @staticmethod
    def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not t.is_cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        return host

    def _staged(self, call: Any, send: torch.Tensor | None, recv: torch.Tensor | None, *args: Any) -> None:
        """``call(host_send, host_recv, *args)`` with ``recv`` written back to the device afterwards."""
        if not ((send is not None and send.is_cuda) or (recv is not None and recv.is_cuda)):
            call(send, recv, *args)
            return
        host_send = self._to_host(send)
        host_recv = host_send if recv is send else self._to_host(recv)
        call(host_send, host_recv, *args)
        if recv is not None and host_recv is not None and host_recv is not recv:
            recv.copy_(host_recv)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self._staged(lambda s, r: super(HostStagedTorchEngine, self).broadcast(r, root), t, t)

    def broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        self.broadcast(t, root)
        return EngineWork(lambda: None, lambda: True, t)

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        self._staged(super().allreduce, send, recv, op)

    def allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        self.allreduce(send, recv, op)
        return EngineWork(lambda: None, lambda: True, send, recv)

    def reduce(self, send: torch.Tensor, recv: torch.Tensor, root: int, op: ReduceOp) -> None:
        self._staged(super().reduce, send, recv, root, op)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        self._staged(super().allgather, send, recv, counts)

    def allgather_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Work:
        self.allgather(send, recv, counts)
        return EngineWork(lambda: None, lambda: True, send, recv)

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                 recv_counts: Sequence[int]) -> None:
        self._staged(super().alltoall, send, recv, send_counts, recv_counts)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], op: ReduceOp) -> None:
        self._staged(super().reduce_scatter, send, recv, counts, op)

    def reduce_scatter_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                             op: ReduceOp) -> Work:
        self.reduce_scatter(send, recv, counts, op)
        return EngineWork(lambda: None, lambda: True, send, recv)

    def _raw_send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        host = self._to_host(t)
        super()._raw_send(host if host is not None else t, dest, tag)

    def _raw_recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self._staged(lambda s, r: super(HostStagedTorchEngine, self)._raw_recv(r, source, tag), None, t)


def shares_gpus(device: torch.device, local_size: int, gpus: int) -> bool:
    """Whether this host's ranks outnumber its GPUs while this rank uses one (more ranks than GPUs on a host: the
    usual way to debug a distributed script on a one-GPU workstation)."""
    return device.type == "cuda" and local_size > gpus


SHARED_GPU_WARNING = (
    "{ranks} ranks share {gpus} GPU(s) on this host: NCCL needs a GPU of its own per rank, so CUDA tensors travel "
    "through pinned host memory over gloo (two copies and a synchronisation per collective: much slower than NCCL). "
    "Start at most {gpus} rank(s) per host (torchrun --nproc_per_node {gpus}) to use NCCL, or set "
    "UNIDIST_DEVICE=cpu to train on the CPU.")


class TorchManager(Manager):
    """torch.distributed process group over env:// rendezvous."""

    name = "torch"
    _over_mpi = False  # the rendezvous address came over MPI (the job was started by an MPI launcher)
    _listen: socket.socket | None = None  # rank 0's listening socket until its store takes it
    _store: Any = None  # the process group's store, kept for leaving in order (``_shutdown``)

    # ------------------------------------------------------------ lifecycle
    def _import_dist(self) -> Any:
        import torch.distributed as dist

        if not dist.is_available():
            raise BackendUnavailableError("this torch build has no torch.distributed; install a torch wheel from "
                                          "PyPI (pip install torch)")
        return dist

    def _rendezvous(self) -> None:
        """Make the env:// variables true for this process, from whatever the launcher provided; rank 0 also
        opens the store's listening socket (``self._listen``) on the rendezvous address only."""
        launch = self.launch
        self._setenv("RANK", str(launch.rank))
        self._setenv("WORLD_SIZE", str(launch.size))
        self._setenv("LOCAL_RANK", str(launch.local_rank))
        if launch.master_addr and launch.master_port:
            addr, port = launch.master_addr, launch.master_port
            if launch.rank == 0 and launch.launcher != "torchrun":  # torchrun's agent hosts the store
                self._listen = store_listener(addr, port)
        elif launch.size == 1:
            self._listen = store_listener("127.0.0.1", 0)
            addr, port = "127.0.0.1", self._listen.getsockname()[1]
        else:
            fam = family(launch.launcher)
            shared = _share_address_over_mpi(launch.rank, launch.size, launch.local_size == launch.size) \
                if fam and fam.mpi_like else None
            if shared is None:
                raise LaunchEnvironmentError(
                    f"the {self.name} backend needs MASTER_ADDR and MASTER_PORT for a {launch.size}-process run "
                    f"started by {launch.launcher}; set both (rank 0's host and a free port), or pip install mpi4py "
                    "and start with a launcher that gives MPI the job's processes (srun --mpi=pmi2 or pmix, "
                    "mpiexec) so unidist can share them over MPI"
                )
            self._over_mpi = True
            addr, port, self._listen = shared
        self._setenv("MASTER_ADDR", addr)
        self._setenv("MASTER_PORT", str(port))

    _shared_gpu = False  # more ranks than GPUs on this host (shares_gpus): gloo, CUDA tensors staged on the host

    def _process_group_backend(self) -> str:
        """gloo on CPU. On GPU, nccl for CUDA tensors and gloo beside it for CPU ones: users may pass CPU
        tensors, and unidist's own control tensors (row counts, desync signatures, pickled objects) are
        CPU tensors; an nccl-only group cannot move them. Ranks sharing a GPU: gloo alone (NCCL refuses them)."""
        if self._device.type == "cuda" and not self._shared_gpu:
            return "cpu:gloo,cuda:nccl"
        return "gloo"

    def _init_group(self) -> None:
        timeout = watchdog.engine_timeout(self.config.timeout)
        launch = self.launch
        import torch.distributed

        dist: Any = torch.distributed  # TCPStore, PrefixStore: not in its typed exports (DeepSpeed uses this group)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if self._listen is not None:  # rank 0 serves on the socket it holds (see managers/stores.py)
            sock, self._listen = self._listen, None
            store = stores.serve(sock, launch.size, timeout)
        else:
            store = stores.connect(host, port, launch.size, timeout)
        if launch.launcher == "torchrun":
            # torchrun's agent hosts the store and, on a restart (--max-restarts), the same store serves the
            # new attempt: keys left by the killed attempt (a dead rank's gloo address) were read by the new
            # one (measured: connection refused, then a hang). Every attempt gets keys of its own.
            store = dist.PrefixStore(f"unidist/attempt_{launch.attempt}", store)
        dist.init_process_group(self._process_group_backend(), store=store, rank=launch.rank,
                                world_size=launch.size, timeout=timeout)
        self._store = store

    def _start(self) -> Engine:
        self._dist = self._import_dist()
        launch = self.launch
        self._local_rank, self._local_size, self._node_rank = launch.local_rank, launch.local_size, launch.node_rank
        self._device = self._pick_device()
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
            self._shared_gpu = shares_gpus(self._device, launch.local_size, torch.cuda.device_count())
            if self._shared_gpu:
                self._refuse_shared_gpu()
                if launch.local_rank == 0:
                    _log.warning(SHARED_GPU_WARNING.format(ranks=launch.local_size, gpus=torch.cuda.device_count()))
        self._owns_group = not self._dist.is_initialized()
        if self._owns_group:
            self._rendezvous()
            try:
                self._init_group()
            except Exception:
                if self._over_mpi:  # the peers wait for this rank's store: end the MPI job instead of a hang
                    _abort_mpi_job()
                raise
        rank, size = self._dist.get_rank(), self._dist.get_world_size()
        if launch.launched and (rank, size) != (launch.rank, launch.size):
            raise LaunchEnvironmentError(
                f"the process group says rank {rank} of {size} but the {launch.launcher} launcher "
                f"announced rank {launch.rank} of {launch.size}"
            )
        # a receiver tells the sender of a refused message through the store (comm/mismatch.py); a group made
        # outside unidist leaves no store in hand: only the receiver raises there
        verdicts = Verdicts(self._store, rank) if self._store is not None and size > 1 else None
        engine = HostStagedTorchEngine if self._shared_gpu else TorchEngine
        return engine(self._dist, rank, size, verdicts=verdicts)

    def _refuse_shared_gpu(self) -> None:
        """A backend that cannot run with ranks sharing a GPU says so here, before any rendezvous (torch's own
        collectives can: staged through the host)."""

    def _shutdown(self) -> None:
        # Manager.shutdown has made the ranks meet first: a rank destroying its gloo group while a peer was still
        # finishing its last exchange aborted the process ("terminate called without an active exception")
        store, self._store = self._store, None
        if not (self._owns_group and self._dist.is_initialized()):
            return
        if store is None or self._failing or self._size == 1:
            self._dist.destroy_process_group()
            return
        stores.leave_in_order(store, self._rank, self._size, self.config.timeout, self._dist.destroy_process_group)


def store_listener(addr: str, port: int, fallback_any: bool = True) -> socket.socket:
    """Rank 0's listening socket for the store, or a LaunchEnvironmentError naming the address and port;
    ``fallback_any`` for an address the launcher gave (see ``net.listener``)."""
    try:
        return listener(addr, port, fallback_any=fallback_any)
    except OSError as err:
        raise LaunchEnvironmentError(
            f"rank 0 cannot listen on MASTER_ADDR={addr} MASTER_PORT={port} ({err.strerror}): give an address "
            "of this host and a port free on it (another job may hold it)") from err


def _share_address_over_mpi(rank: int, size: int, single_node: bool) -> tuple[str, int, socket.socket | None] | None:
    """Rank 0's address and port, broadcast with mpi4py's buffer Bcast, and on rank 0 the socket already
    listening there; None without mpi4py, or when MPI's world is not the launch's: a launcher that gives MPI no
    process manager (srun without PMI) leaves every process a world of its own, whose broadcast carries nothing
    (measured on the simulated cluster: ranks > 0 read an empty address and failed on ``int('')``)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    if MPI.COMM_WORLD.Get_size() != size:
        return None
    import numpy as np

    buf = np.zeros(256, dtype=np.uint8)
    sock = None
    if rank == 0:
        addr = rendezvous_address(single_node)
        try:
            sock = store_listener(addr, 0, fallback_any=False)  # an address of ours: it must work
        except LaunchEnvironmentError:  # the peers wait in the Bcast below: end the MPI job instead of a hang
            _abort_mpi_job()
        text = f"{addr}:{sock.getsockname()[1]}".encode()
        buf[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    MPI.COMM_WORLD.Bcast([buf, MPI.BYTE], root=0)
    addr, _, port = bytes(buf).rstrip(b"\0").decode().rpartition(":")
    return addr, int(port), sock


def _abort_mpi_job() -> NoReturn:
    """Print this rank's error and abort every rank of the MPI job (mpi4py is loaded: it carried the address)."""
    import sys
    import traceback

    from mpi4py import MPI

    traceback.print_exc()
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)
    raise SystemExit(1)  # not reached: Abort ends the process

