"""HorovodManager on ``horovod.torch``.

Horovod has no gather, scatter or point-to-point calls. gather and scatter are built from its alltoall
(the base class's derivation: everyone sends only to root, or root sends to everyone). send/recv have no
collective equivalent, so they go over a small gloo process group that start() builds beside Horovod,
on a TCPStore whose address rank 0 broadcasts with Horovod itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from unidist.comm import watchdog
from unidist.comm.engine import Engine, SortedOrder
from unidist.comm.mismatch import Framing, Verdicts
from unidist.comm.work import EngineWork, Work
from unidist.engines.horovod import gloo as horovod_gloo
from unidist.engines.mpi import shm as mpi_shm
from unidist.errors import BackendUnavailableError, LaunchEnvironmentError
from unidist.launch import slurm_step_hosts
from unidist.managers import stores
from unidist.managers.base import Manager
from unidist.net import listener, rendezvous_address
from unidist.ops import ReduceOp

__all__ = ["HorovodEngine", "HorovodManager"]

HOROVOD_GLOO_TIMEOUT = 30  # Horovod's own default for HOROVOD_GLOO_TIMEOUT_SECONDS (common/gloo/gloo_context.cc:63)

INSTALL_HINT = ("Horovod 0.28.1 needs a patched build against torch >= 2.1: run "
                "`bash launch_scripts/install_horovod.sh` in this environment (see README, Horovod)")


class HorovodEngine(SortedOrder, Engine):
    """horovod.torch primitives over one process set (``global_process_set`` for the world).

    Horovod keeps a process set's ranks sorted (``SortedOrder`` permutes chunks for groups ordered otherwise)
    and names broadcast roots by world rank.
    send/recv go over the world's side gloo group (Horovod has no point-to-point), peers translated.
    """

    # horovod.torch reduces neither bfloat16 nor 8/16-bit integers
    upcast_reduce: ClassVar[Mapping[torch.dtype, torch.dtype]] = {
        torch.bfloat16: torch.float32, torch.int8: torch.int32, torch.int16: torch.int32, torch.uint8: torch.int32}
    # ... nor moves bfloat16 or bool tensors: their bits travel as float16 and uint8
    wire_dtypes: ClassVar[Mapping[torch.dtype, torch.dtype]] = {torch.bfloat16: torch.float16, torch.bool: torch.uint8}

    def __init__(self, hvd: Any, p2p: Any, process_set: Any, sets: dict[tuple[int, ...], Any],
                 members: Sequence[int] | None = None, verdicts: Verdicts | None = None) -> None:
        world = hvd.rank()
        super().__init__(world if members is None else list(members).index(world),
                         hvd.size() if members is None else len(members))
        self._hvd, self._p2p, self._ps, self._sets = hvd, p2p, process_set, sets
        self._members = None if members is None else tuple(members)  # world ranks in group order; None: the world
        if members is not None:
            self._set_order(members)
        self._ops = {ReduceOp.SUM: hvd.Sum, ReduceOp.MIN: hvd.Min, ReduceOp.MAX: hvd.Max,
                     ReduceOp.PRODUCT: hvd.Product}
        self._calls = 0
        self._framing = Framing(self._raw_send, self._raw_recv, rank=self.rank, world=self._world, verdicts=verdicts)

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        """A process set per list (every rank registers every set, in the same order; Horovod refuses a set
        registered twice, so ``_sets`` keeps them, and the Manager removes them at shutdown)."""
        out: list[Engine | None] = []
        for ranks in lists:
            key = tuple(sorted(ranks))
            ps = self._sets.get(key)
            if ps is None:
                ps = self._hvd.global_process_set if len(key) == self._hvd.size() else self._hvd.add_process_set(key)
                self._sets[key] = ps
            member = self._hvd.rank() in ranks
            out.append(HorovodEngine(self._hvd, self._p2p, ps, self._sets, ranks, self._framing.verdicts)
                       if member else None)
        return out

    def grouped_allreduce(self, xs: Sequence[Any], op: ReduceOp, inplace: bool) -> list[Any] | None:
        """``hvd.grouped_allreduce(_)`` for torch tensors Horovod can reduce (in place: contiguous ones); None
        for anything else (numpy, bf16, bool, int8/16), which the communicator fuses itself."""
        native = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
        if not all(type(x) is torch.Tensor and x.dtype in native and (x.is_contiguous() or not inplace) for x in xs):
            return None
        if op is ReduceOp.MEAN:
            if not all(x.dtype.is_floating_point for x in xs):
                return None
            hvd_op = self._hvd.Average
        else:
            hvd_op = self._ops[op]
        name, tensors = self._name("gar"), [x.detach() for x in xs]
        if inplace:
            self._hvd.grouped_allreduce_(tensors, op=hvd_op, name=name, process_set=self._ps)
            return list(xs)
        return list(self._hvd.grouped_allreduce(tensors, op=hvd_op, name=name, process_set=self._ps))

    def _world(self, rank: int) -> int:
        return rank if self._members is None else self._members[rank]

    def _name(self, kind: str) -> str:
        """Horovod matches ops across ranks by name, and its default names count every op this process
        started, on any process set: ranks of different groups would disagree and wait forever. Ours count
        per communicator, which all its members call alike."""
        self._calls += 1
        return f"unidist.{self._ps.process_set_id}.{kind}.{self._calls}"

    def _work(self, handle: Any, *keep: object) -> Work:
        hvd = self._hvd
        return EngineWork(lambda: hvd.synchronize(handle), lambda: hvd.poll(handle), *keep)

    def barrier(self) -> None:
        self._hvd.barrier(process_set=self._ps)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self._hvd.broadcast_(t, self._world(root), name=self._name("bc"), process_set=self._ps)

    def broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        return self._work(self._hvd.broadcast_async_(t, self._world(root), name=self._name("bc"), process_set=self._ps),
                          t)

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        if send is not recv:
            recv.copy_(send)
        self._hvd.allreduce_(recv, op=self._ops[op], name=self._name("ar"), process_set=self._ps)

    def allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        if send is not recv:
            recv.copy_(send)
        return self._work(self._hvd.allreduce_async_(recv, op=self._ops[op], name=self._name("ar"),
                                                      process_set=self._ps), send, recv)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        out = self._hvd.allgather(send.reshape(-1), name=self._name("ag"), process_set=self._ps)  # uneven: fine
        recv.view(-1).copy_(self._from_engine_order(out, counts))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        flat = self._to_engine_order(send.reshape(-1), send_counts)
        splits = torch.tensor(self._permuted(send_counts), dtype=torch.int32)
        out = self._hvd.alltoall(flat, splits=splits, name=self._name("a2a"), process_set=self._ps)
        if isinstance(out, tuple):  # newer Horovod also returns the received splits
            out = out[0]
        recv.view(-1).copy_(self._from_engine_order(out, recv_counts))

    # every message framed with its dtype and size (comm/mismatch.py): gloo accepts a shorter message silently
    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._framing.send(t, dest, tag)

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self._framing.recv(t, source, tag)

    def pending_mismatch(self) -> Exception | None:
        return self._framing.pending()

    def _raw_send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._p2p.send([t], self._world(dest), tag).wait()

    def _raw_recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self._p2p.recv([t], self._world(source), tag).wait()


class HorovodManager(Manager):
    """Horovod collectives; topology from Horovod (cross_rank is the node)."""

    name = "horovod"
    _gloo_rendezvous: horovod_gloo.Rendezvous | None = None  # rank 0 serves it under srun without PMI

    @property
    def engine_api(self) -> Any:
        """``horovod.torch`` (its trainer uses Horovod's own optimizer and broadcasts)."""
        return self._hvd

    def _start(self) -> Engine:
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise BackendUnavailableError(f"the 'horovod' backend needs horovod.torch ({err}); {INSTALL_HINT}") \
                from err
        # Horovod's gloo controller times out after HOROVOD_GLOO_TIMEOUT_SECONDS (30 s by default). With dynamic
        # process sets its background loop holds the process-set table's mutex across a gloo allgather of every
        # rank each cycle (horovod 0.28.1 common/process_set.cc:179-187), and every enqueue takes that mutex
        # (common/operations.cc:1449,1456) from a binding that keeps the GIL (torch/mpi_ops_v2.cc:76,1142):
        # with a peer stopped, a rank entering a backward waits there holding the GIL, its watchdog thread cannot
        # run, and only the backstop would end it, naming nobody. The engines' timeout (UNIDIST_TIMEOUT + 10 s),
        # before the backstop's, frees it with an error that unidist names (engines/horovod/trainer.py,
        # watchdog.explaining). Never later than Horovod's default (it also bounds how far apart the ranks may
        # reach hvd.init: 8 s failed a third of the starts under load); a user's own value stays.
        seconds = int(watchdog.engine_timeout(self.config.timeout).total_seconds())
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(min(HOROVOD_GLOO_TIMEOUT, seconds)))
        self._gloo_rendezvous = None
        if self.launch.launcher == "slurm":  # srun without PMI: no MPI world, so Horovod's gloo, met at rank 0
            self._gloo_rendezvous = horovod_gloo.start(self.launch, slurm_step_hosts(os.environ), self._setenv,
                                                       watchdog.engine_timeout(self.config.timeout).total_seconds())
        elif self.launch.launcher != "horovodrun":  # Horovod's MPI_Init: clear what a killed job left first
            mpi_shm.remove_stale()
        hvd.init(process_sets="dynamic")  # groups are registered at run time (split, new_group)
        if self.launch.launched and hvd.size() != self.launch.size:
            size = hvd.size()
            hvd.shutdown()
            raise LaunchEnvironmentError(
                f"the {self.launch.launcher} launcher started {self.launch.size} processes but Horovod sees a world "
                f"of {size}: Horovod meets over MPI (mpiexec, srun --mpi=pmi2) or over gloo when horovodrun "
                "started the job (horovodrun --gloo); start it one of those ways")
        self._hvd = hvd  # its trainer (trainer.py) uses Horovod's own training calls, through engine_api
        self._process_sets: dict[tuple[int, ...], Any] = {}
        self._local_rank, self._local_size, self._node_rank = hvd.local_rank(), hvd.local_size(), hvd.cross_rank()
        self._p2p: Any = None
        self._p2p_store: Any = None  # rank 0 hosts it: closed after the others left (managers/stores.py)
        if hvd.size() > 1:
            self._p2p = self._p2p_group()
        verdicts = Verdicts(self._p2p_store, hvd.rank()) if self._p2p_store is not None else None
        return HorovodEngine(hvd, self._p2p, hvd.global_process_set, self._process_sets, verdicts=verdicts)

    def _p2p_group(self) -> Any:
        import torch.distributed

        dist: Any = torch.distributed  # TCPStore, PrefixStore, ProcessGroupGloo: not in its typed exports
        timeout = watchdog.engine_timeout(self.config.timeout)
        rank, size = self._hvd.rank(), self._hvd.size()
        single_node = self._local_size == size
        if rank == 0:  # one address only, port held from the start (see managers/stores.py)
            sock = listener(rendezvous_address(single_node))
            address = sock.getsockname()[:2]
            store = stores.serve(sock, size, timeout)
        else:
            address = None
        host, port = self._hvd.broadcast_object(address, root_rank=0, name="unidist.p2p.address")
        if rank != 0:
            store = stores.connect(host, port, size, timeout)
        self._p2p_store = store
        return dist.ProcessGroupGloo(dist.PrefixStore("unidist_p2p", store), rank, size, timeout)

    def _shutdown(self) -> None:
        for ps in self._process_sets.values():
            if ps is not self._hvd.global_process_set:
                self._hvd.remove_process_set(ps)
        self._process_sets.clear()
        if self._p2p is not None and not self._failing:
            stores.leave_in_order(self._p2p_store, self._rank, self._size, self.config.timeout, self._drop_p2p)
        self._drop_p2p()
        self._hvd.shutdown()
        if self._gloo_rendezvous is not None:
            self._gloo_rendezvous.stop()

    def _drop_p2p(self) -> None:
        self._p2p = self._p2p_store = None
