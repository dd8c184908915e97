"""HorovodManager on ``horovod.torch``.

Horovod has no gather, scatter or point-to-point calls. gather and scatter are built from its alltoall
(the base class's derivation: everyone sends only to root, or root sends to everyone). send/recv have no
collective equivalent, so they go over a small gloo process group that start() builds beside Horovod,
on a TCPStore whose address rank 0 broadcasts with Horovod itself.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from unidist.errors import BackendUnavailableError, InvalidArgumentError
from unidist.managers.base import EngineWork, Manager, Work
from unidist.ops import ReduceOp, resolve_op
from unidist.optim.view import OptimizerView

if TYPE_CHECKING:
    from unidist.optim.options import TrainOptions

__all__ = ["HorovodManager", "HorovodOptimizer"]

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

    # ------------------------------------------------------------ training, with Horovod's own tools
    def broadcast_parameters(self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]
                             | Iterable[tuple[str, torch.Tensor]], root: int = 0) -> None:
        """``hvd.broadcast_parameters`` on a module's state_dict (or a state dict / named tensors)."""
        self._check_root(root)
        if isinstance(model_or_state, torch.nn.Module):
            state: Any = model_or_state.state_dict()
        else:
            state = model_or_state if isinstance(model_or_state, Mapping) else dict(model_or_state)
        self._hvd.broadcast_parameters(state, root_rank=root)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                              op: ReduceOp | str = ReduceOp.MEAN, compression: str | None = None,
                              backward_passes_per_step: int = 1, bucket_mb: float | None = None,
                              clip_grad_norm: float | None = None) -> Any:
        """``hvd.DistributedOptimizer`` with the contract's arguments, behind the uniform loop (``step`` and
        ``zero_grad`` after every backward act on every k-th). Horovod fuses by its own
        HOROVOD_FUSION_THRESHOLD (read at init), so ``bucket_mb`` is checked and otherwise unused.

        Horovod's defaults that would change the math are pinned: gradients averaged after the sum
        (``gradient_predivide_factor=1``), no sparse-as-dense or Adasum, and the optimizer's existing state
        (e.g. a resumed Adam) carried over, which ``hvd.DistributedOptimizer`` alone would drop."""
        from unidist.optim.options import check_bucket_mb, check_clip, check_passes, check_sync_op

        where = "distributed_optimizer"
        rop = check_sync_op(op, where)
        check_passes(backward_passes_per_step, where)
        check_clip(clip_grad_norm, where)
        if bucket_mb is not None:
            check_bucket_mb(bucket_mb, where)
        hvd = self._hvd
        compressor = self._compressor(compression if compression is not None else self.config.compression)
        hvd_opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=list(named_parameters) if named_parameters is not None else None,
            compression=compressor, backward_passes_per_step=backward_passes_per_step,
            op=hvd.Average if rop is ReduceOp.MEAN else hvd.Sum, gradient_predivide_factor=1.0,
            sparse_as_dense=False)
        hvd_opt.load_state_dict(optimizer.state_dict())  # Horovod builds a fresh optimizer from param_groups
        return HorovodOptimizer(hvd_opt, backward_passes_per_step, clip_grad_norm)

    def _compressor(self, name: str) -> Any:
        comp = self._hvd.Compression
        if name == "none":
            return comp.none
        if name == "fp16":
            return comp.fp16
        if name == "bf16":
            raise InvalidArgumentError("Horovod 0.28 cannot allreduce bfloat16 tensors, so compression='bf16' is "
                                       "unavailable on the horovod backend; use compression='fp16'")
        raise InvalidArgumentError(f"compression={name!r}; use none, fp16 or bf16")

    def _prepare(self, model: torch.nn.Module, optimizer: Any, opts: TrainOptions
                 ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Model on ``device``, rank 0's parameters and optimizer state everywhere, Horovod's optimizer behind
        the uniform loop."""
        if opts.zero_stage:
            raise InvalidArgumentError("Horovod has no ZeRO sharding; use zero_stage=0 or the deepspeed backend")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"prepare(optimizer=...) takes a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        self._compressor(opts.compression)  # refuse bf16 before anything changes
        model = model.to(self._device)
        self.broadcast_parameters(model)
        self.broadcast_optimizer_state(optimizer)
        self._prepared = self.distributed_optimizer(
            optimizer, model.named_parameters(), op=opts.op, compression=opts.compression,
            backward_passes_per_step=opts.backward_passes_per_step, clip_grad_norm=opts.clip_grad_norm)
        return model, self._prepared

    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._p2p.send([t], dest, tag).wait()

    def _recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self._p2p.recv([t], source, tag).wait()


class HorovodOptimizer(OptimizerView):
    """``hvd.DistributedOptimizer`` as a torch Optimizer for the uniform loop.

    Horovod expects ``step()`` once per k backward passes; the uniform loop calls it after every pass (as
    with a DeepSpeed engine), so only every k-th call goes through. Clipping needs the averaged gradient:
    ``synchronize()``, clip, then Horovod's step inside ``skip_synchronize()`` so nothing is reduced twice;
    an explicit ``synchronize()`` by the user is honoured the same way.
    """

    def __init__(self, hvd_optimizer: Any, k: int, clip_grad_norm: float | None) -> None:
        super().__init__(hvd_optimizer)
        self.backward_passes_per_step, self.clip_grad_norm = k, clip_grad_norm
        self._calls = 0
        self._synced = False

    def synchronize(self) -> None:
        """Wait for the averaged gradients (written into ``p.grad``); the next ``step()`` uses them as they are."""
        self.optimizer.synchronize()
        self._synced = True

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise InvalidArgumentError("the prepared optimizer's step takes no closure (the loss must be computed "
                                       "before gradients are averaged)")
        self._calls += 1
        if self._calls % self.backward_passes_per_step:
            return None
        if self.clip_grad_norm is not None:
            if not self._synced:
                self.optimizer.synchronize()
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            self._synced = True
        try:
            if self._synced:
                with self.optimizer.skip_synchronize():
                    return self.optimizer.step()
            return self.optimizer.step()
        finally:
            self._synced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._calls % self.backward_passes_per_step == 0:
            self.optimizer.zero_grad()  # Horovod's zero_grad takes no set_to_none


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
