"""HorovodManager on ``horovod.torch``.

Horovod has no gather, scatter or point-to-point calls. gather and scatter are built from its alltoall
(the base class's derivation: everyone sends only to root, or root sends to everyone). send/recv have no
collective equivalent, so they go over a small gloo process group that start() builds beside Horovod,
on a TCPStore whose address rank 0 broadcasts with Horovod itself.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from unidist.errors import BackendUnavailableError
from unidist.managers.base import EngineWork, Manager, Work
from unidist.ops import ReduceOp, resolve_op

__all__ = ["HorovodManager"]

INSTALL_HINT = ("Horovod 0.28.1 needs a patched build against torch >= 2.1: run "
                "`bash launch_scripts/install_horovod.sh` in this environment (see README, Horovod)")


class HorovodManager(Manager):
    """Horovod collectives; topology from Horovod (cross_rank is the node)."""

    # Not hvd.broadcast_optimizer_state: on an optimizer without state it takes a step with zero gradients
    # to create some, which makes Adam's step count 1 before training starts (weights 8e-3 away from one
    # process after 6 steps). The base class broadcasts the state as it is.
    name = "horovod"
    # horovod.torch reduces neither bfloat16 nor 8/16-bit integers
    _upcast_reduce: ClassVar[Mapping[torch.dtype, torch.dtype]] = {
        torch.bfloat16: torch.float32, torch.int8: torch.int32, torch.int16: torch.int32, torch.uint8: torch.int32}
    # ... nor moves bfloat16 or bool tensors: their bits travel as float16 and uint8
    _wire_dtypes: ClassVar[Mapping[torch.dtype, torch.dtype]] = {torch.bfloat16: torch.float16, torch.bool: torch.uint8}

    def _start(self) -> None:
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise BackendUnavailableError(f"the 'horovod' backend needs horovod.torch ({err}); {INSTALL_HINT}") \
                from err
        hvd.init()
        self._hvd = hvd
        self._rank, self._size = hvd.rank(), hvd.size()
        self._local_rank, self._local_size, self._node_rank = hvd.local_rank(), hvd.local_size(), hvd.cross_rank()
        self._ops = {ReduceOp.SUM: hvd.Sum, ReduceOp.MIN: hvd.Min, ReduceOp.MAX: hvd.Max,
                     ReduceOp.PRODUCT: hvd.Product}
        self._p2p: Any = None
        if self._size > 1:
            self._p2p = self._p2p_group()

    def _p2p_group(self) -> Any:
        import torch.distributed

        dist: Any = torch.distributed  # TCPStore, PrefixStore, ProcessGroupGloo: not in its typed exports
        timeout = datetime.timedelta(seconds=self.config.timeout)
        if self._rank == 0:
            store = dist.TCPStore("0.0.0.0", 0, self._size, is_master=True, timeout=timeout,  # noqa: S104
                                  wait_for_workers=False)
            address = (_host_address(), store.port)
        else:
            address = None
        host, port = self._hvd.broadcast_object(address, root_rank=0, name="unidist.p2p.address")
        if self._rank != 0:
            store = dist.TCPStore(host, port, self._size, is_master=False, timeout=timeout)
        return dist.ProcessGroupGloo(dist.PrefixStore("unidist_p2p", store), self._rank, self._size, timeout)

    def _shutdown(self) -> None:
        self._p2p = None
        self._hvd.shutdown()

    # ------------------------------------------------------------ primitives
    def _work(self, handle: Any, *keep: object) -> Work:
        hvd = self._hvd
        return EngineWork(lambda: hvd.synchronize(handle), lambda: hvd.poll(handle), *keep)

    def _barrier(self) -> None:
        self._hvd.barrier()

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        self._hvd.broadcast_(t, root)

    def _broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        return self._work(self._hvd.broadcast_async_(t, root), t)

    def _allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        if send is not recv:
            recv.copy_(send)
        self._hvd.allreduce_(recv, op=self._ops[op])

    def _allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        if send is not recv:
            recv.copy_(send)
        return self._work(self._hvd.allreduce_async_(recv, op=self._ops[op]), send, recv)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        recv.view(-1).copy_(self._hvd.allgather(send.reshape(-1)))  # Horovod takes uneven first dims itself

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        out = self._hvd.alltoall(send.reshape(-1), splits=torch.tensor(send_counts, dtype=torch.int32))
        if isinstance(out, tuple):  # newer Horovod also returns the received splits
            out = out[0]
        recv.view(-1).copy_(out)

    # ------------------------------------------------------------ grouped ops: Horovod's own call
    def grouped_allreduce(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM) -> list[Any]:
        """``hvd.grouped_allreduce`` for torch tensors Horovod can reduce; anything else (numpy, bf16, bool,
        int8/16, checked runs) takes the base class's fused path."""
        hvd_op = self._grouped_op(xs, op)
        if hvd_op is None:
            return super().grouped_allreduce(xs, op)
        return list(self._hvd.grouped_allreduce([x.detach() for x in xs], op=hvd_op))

    def grouped_allreduce_(self, xs: Sequence[Any], op: ReduceOp | str = ReduceOp.SUM) -> list[Any]:
        """``hvd.grouped_allreduce_`` in place, under the same conditions as ``grouped_allreduce``."""
        hvd_op = self._grouped_op(xs, op)
        if hvd_op is None or not all(x.is_contiguous() for x in xs):
            return super().grouped_allreduce_(xs, op)
        self._hvd.grouped_allreduce_([x.detach() for x in xs], op=hvd_op)
        return list(xs)

    def _grouped_op(self, xs: Sequence[Any], op: ReduceOp | str) -> Any:
        rop = resolve_op(op)
        native = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
        if not xs or self.config.check_collectives or not all(
                type(x) is torch.Tensor and x.dtype in native for x in xs):
            return None
        if rop is ReduceOp.MEAN:
            return self._hvd.Average if all(x.dtype.is_floating_point for x in xs) else None
        return self._ops[rop]

    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._p2p.send([t], dest, tag).wait()

    def _recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self._p2p.recv([t], source, tag).wait()


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
