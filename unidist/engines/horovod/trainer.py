"""Horovod's own training behind ``prepare``: ``hvd.broadcast_parameters`` and ``hvd.DistributedOptimizer``.

Horovod defaults that change the math are pinned or avoided: gradients are averaged after the sum
(``gradient_predivide_factor=1``); ``hvd.broadcast_optimizer_state`` is not used, because on an optimizer
without state it takes a step with zero gradients to create some (Adam then starts at step 1, 7.8e-3 away from
one process after 6 steps), and ``hvd.DistributedOptimizer``, which builds a new optimizer from the
parameter groups, gets the user's existing state loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from unidist.checkpoint.layout import FullLayout
from unidist.comm import timeline, watchdog
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.request import PrepareRequest, SyncOptions
from unidist.train.precision import LossScaler, Precision
from unidist.train.prepared import Prepared, one_way_to_accumulate
from unidist.train.trainer import Trainer

__all__ = ["HorovodOptimizer", "HorovodTrainer"]


class HorovodTrainer(Trainer):
    """Horovod's optimizer for the whole world; with ``group=`` unidist's own over that group."""

    def backward(self, loss: torch.Tensor) -> None:
        """Horovod's hooks enqueue each gradient during the backward; an enqueue can block holding the GIL
        while a peer is stopped (engines/horovod/manager.py says why) until Horovod's own gloo timeout ends it, so
        the error that frees it names the peers that stopped or died."""
        with watchdog.explaining("hvd backward (gradient enqueue)"):
            super().backward(loss)

    def broadcast_parameters(self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]
                             | Iterable[tuple[str, torch.Tensor]], root: int = 0) -> None:
        """``hvd.broadcast_parameters`` on a module's state_dict (or a state dict / named tensors)."""
        root = self.mgr.check_root(root)
        if isinstance(model_or_state, torch.nn.Module):
            state: Any = model_or_state.state_dict()
        else:
            state = model_or_state if isinstance(model_or_state, Mapping) else dict(model_or_state)
        # Horovod 0.28 cannot move bfloat16: broadcast its bits (an int16 view, written in place)
        state = {k: v.view(torch.int16) if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v
                 for k, v in state.items()}
        with timeline.watching("hvd.broadcast_parameters"):
            self.mgr.engine_api.broadcast_parameters(state, root_rank=root)

    def _distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                               named_parameters: Iterable[tuple[str, torch.Tensor]] | None, sync: SyncOptions,
                               bf16_params: bool = False) -> HorovodOptimizer:
        """``hvd.DistributedOptimizer`` with the contract's arguments, behind the uniform loop (``step`` and
        ``zero_grad`` after every backward act on every k-th). Horovod fuses by its own
        HOROVOD_FUSION_THRESHOLD (read at init), so ``bucket_mb`` is checked and otherwise unused.

        Horovod's defaults that would change the math are pinned: gradients averaged after the sum
        (``gradient_predivide_factor=1``), no sparse-as-dense or Adasum, and the optimizer's existing state
        (e.g. a resumed Adam) carried over, which ``hvd.DistributedOptimizer`` alone would drop. Horovod 0.28
        cannot reduce bfloat16, so a bfloat16 model's gradients travel as float32 (``bf16_params``)."""
        hvd = self.mgr.engine_api
        compressor = self._compressor(sync.compression, bf16_params)
        hvd_opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=list(named_parameters) if named_parameters is not None else None,
            compression=compressor, backward_passes_per_step=sync.backward_passes_per_step,
            op=hvd.Average if sync.op is ReduceOp.MEAN else hvd.Sum, gradient_predivide_factor=1.0,
            sparse_as_dense=False)
        hvd_opt.load_state_dict(optimizer.state_dict())  # Horovod builds a fresh optimizer from param_groups
        return HorovodOptimizer(hvd_opt, sync.backward_passes_per_step, sync.clip_grad_norm, self.mgr)

    def _compressor(self, name: str, bf16_params: bool = False) -> Any:
        comp = self.mgr.engine_api.Compression
        if name == "none":
            return _upcast_bf16(comp) if bf16_params else comp.none
        if name == "fp16":
            return comp.fp16
        if name == "bf16":
            raise InvalidArgumentError("Horovod 0.28 cannot allreduce bfloat16 tensors, so compression='bf16' is "
                                       "unavailable on the horovod backend; use compression='fp16'")
        raise InvalidArgumentError(f"compression={name!r}; use none or fp16")

    def takes_sparse(self, opts: PrepareRequest) -> bool:
        """``hvd.DistributedOptimizer`` allgathers sparse gradients (an ``nn.Embedding(sparse=True)``); unidist's
        reducer (``reducer='unidist'``, and any mode with master copies, which runs on it) does not."""
        return opts.reducer != "unidist" and not Precision.of(opts.precision).keeps_masters

    def _prepare(self, model: torch.nn.Module, optimizer: Any, opts: PrepareRequest
                 ) -> tuple[torch.nn.Module, Prepared]:
        """Model on ``device``, rank 0's parameters and optimizer state everywhere, Horovod's optimizer behind
        the uniform loop; with ``reducer='unidist'`` unidist's DistributedOptimizer over Horovod's collectives
        (its buckets are one ``hvd.allreduce_async_`` each; the same sum, divided by the ranks). A mode with master
        copies (``"bf16-master"``) goes that way too: Horovod's optimizer steps the very parameters it reduces."""
        if opts.reducer == "unidist" or Precision.of(opts.precision).keeps_masters:
            return self._prepare_unidist(model, optimizer, opts)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"prepare(optimizer=...) takes a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        self._compressor(opts.compression)  # refuse bf16 before anything changes
        model = model.to(self.mgr.device)
        hooks = self._apply_precision(model, opts)
        self.broadcast_parameters(model)
        self.broadcast_optimizer_state(optimizer)
        bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
        self.prepared = self._distributed_optimizer(optimizer, model.named_parameters(), opts, bf16_params=bf16)
        self.prepared.scaler = self._scaler(opts)
        self.prepared.attach_hooks(hooks)
        self.prepared_for[model] = self.prepared  # a second prepare of this model is refused
        return model, self.prepared


class HorovodOptimizer(Prepared):
    """``hvd.DistributedOptimizer`` as a torch Optimizer for the uniform loop.

    Horovod expects ``step()`` once per k backward passes; the uniform loop calls it after every pass (as
    with a DeepSpeed engine), so only every k-th call goes through. Clipping needs the averaged gradient:
    ``synchronize()``, clip, then Horovod's step inside ``skip_synchronize()`` so nothing is reduced twice;
    an explicit ``synchronize()`` by the user is honoured the same way. fp16 loss scaling is the recipe Horovod
    documents for GradScaler (horovod/horovod#1089): ``synchronize()``, unscale (every rank holds the same
    averaged gradients, so every rank finds the same inf), then step inside ``skip_synchronize()`` or skip.
    """

    scaler: LossScaler | None = None

    def __init__(self, hvd_optimizer: Any, k: int, clip_grad_norm: float | None, world: Any) -> None:
        super().__init__(hvd_optimizer)
        self.world = world  # the ranks Horovod averages over (checkpoint_layout)
        self._passes, self.clip_grad_norm = k, clip_grad_norm
        self._calls = 0
        self._synced = False
        self._hooks: list[Any] = []

    def checkpoint_layout(self, model: torch.nn.Module) -> FullLayout:
        """Every rank holds the whole state: each writes an even slice of it."""
        return FullLayout(self.world.rank, self.world.size, model, self.optimizer)

    def synchronize(self) -> None:
        """Wait for the averaged gradients (written into ``p.grad``); the next ``step()`` uses them as they are.

        Horovod gives a parameter that had no gradient a zero one and averages it; one process would have left it
        None, and its optimizer would have skipped it (no weight decay, no momentum). So which parameters had a
        gradient travels too (one small allreduce), and a parameter no rank had one for gets None back."""
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        had = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        with timeline.watching("hvd optimizer.synchronize (gradient exchange)"):
            self.optimizer.synchronize()
        if self.world.size > 1 and params:
            some = self.world.allreduce(had, "sum").tolist()
            for p, n in zip(params, some, strict=True):
                if n == 0:
                    p.grad = None
        self._synced = True

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise InvalidArgumentError("the prepared optimizer's step takes no closure (the loss must be computed "
                                       "before gradients are averaged)")
        self._calls += 1
        if self._calls % self.backward_passes_per_step:
            return None
        result = self._boundary_step()
        self._end_step()
        return result

    def _boundary_step(self) -> Any:
        """The window's last pass: average (unless synchronize() did), unscale and maybe skip, clip, step."""
        try:
            if not self._synced:
                self.synchronize()
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            if self.scaler is not None:
                found = self.scaler.unscale([p.grad for p in params])
                self.scaler.update(found)
            self._begin_step()
            if self.scaler is not None and self.scaler.last_step_skipped:
                return None
            if self.clip_grad_norm is not None:
                self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            with self.optimizer.skip_synchronize():
                return self.optimizer.step()
        finally:
            self._synced = False

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """``Manager.accumulate``: Horovod launches a parameter's allreduce when its countdown of backward passes
        (``_allreduce_delay``, Horovod's own bookkeeping) reaches zero; inside the block the countdowns are set out of
        reach, so nothing is sent, and leaving it ``synchronize()`` reduces every accumulated gradient once (and
        resets the countdowns)."""
        one_way_to_accumulate(self.backward_passes_per_step)
        delay = self.optimizer._allreduce_delay
        saved = dict(delay)
        for p in delay:
            delay[p] = 2**30
        try:
            yield
        except BaseException:
            delay.update(saved)
            raise
        self.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._calls % self.backward_passes_per_step == 0:
            self.optimizer.zero_grad()  # Horovod's zero_grad takes no set_to_none

    def attach_hooks(self, hooks: list[Any]) -> None:
        """Hooks ``remove_hooks()`` detaches too (the precision's forward hooks on the user's module)."""
        self._hooks += hooks

    def remove_hooks(self) -> None:
        """Detach the precision hooks prepare put on the model (Horovod's own gradient hooks stay)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _upcast_bf16(compression: Any) -> Any:
    """A Horovod compressor that sends bfloat16 gradients as float32 (Horovod 0.28 has no bfloat16 reduction)
    and hands them back as bfloat16: the same sum, rounded once, as the other backends compute."""

    class BF16AsFloat32(compression.none):  # type: ignore[name-defined,misc]
        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
            if tensor.dtype == torch.bfloat16:
                return tensor.float(), torch.bfloat16
            return tensor, None

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
            return tensor.to(ctx) if ctx is not None else tensor

    return BF16AsFloat32
