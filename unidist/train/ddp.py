"""DistributedOptimizer: gradient averaging written once on a communicator's collectives (world or Group).

Gradients are reduced by a ``GradientReducer`` (reducer.py): fused into flat buckets in reverse registration
order, as DDP, launched from backward's gradient hooks where the engine overlaps, strictly in order on every
rank, so a parameter that gets no gradient on one rank cannot reorder the collectives: its bucket (and those
after it) go at ``step()`` with zeros for the missing gradient.

The loop is the same as with a DeepSpeed engine: call ``step()`` and ``zero_grad()`` after every
backward; with ``backward_passes_per_step=k`` they act on every k-th call and gradients accumulate
locally in between (``Manager.backward`` divides the loss by k, so the update equals one k-times larger
batch).

It is a ``torch.optim.Optimizer`` sharing the wrapped optimizer's ``param_groups`` and ``state`` (see
``view.py``), so LR schedulers and ``state_dict()`` work as with plain torch. ``clip_grad_norm`` clips the
averaged gradient by its global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` on one process would.
``synchronize()`` may be called before ``step()`` (to read or clip the averaged gradients): ``step()`` then
does not reduce again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from unidist.checkpoint.layout import FullLayout, Layout
from unidist.comm.param_comm import split_by_comm
from unidist.comm.protocol import world_ranks
from unidist.errors import CheckpointError, InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.request import SyncOptions
from unidist.train.expert_layout import ExpertLayout
from unidist.train.gradcore import Compression
from unidist.train.masters import Masters, MastersLayout
from unidist.train.reducer import GradientReducer
from unidist.train.step_window import WindowedOptimizer, clip_summed

if TYPE_CHECKING:
    from unidist.comm.protocol import Comm

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(WindowedOptimizer):
    """Wraps any torch optimizer; see the module docstring for the protocol. ``options`` are checked by
    their maker (``SyncOptions.parse``, which ``prepare`` and ``distributed_optimizer`` call)."""

    def __init__(self, comm: Comm, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 options: SyncOptions | None = None) -> None:
        options = options if options is not None else SyncOptions()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is not None:
            known = {id(p) for _, p in named_parameters}
            missing = [p for p in params if id(p) not in known]
            if missing:
                raise InvalidArgumentError(f"{len(missing)} optimizer parameters are not in named_parameters")
        super().__init__(optimizer)
        self.dp = comm  # the ranks gradients are averaged over (the world or a data-parallel Group)
        self.options = options
        self.op, self.compression = options.op, options.compression
        self._passes, self.clip_grad_norm = options.backward_passes_per_step, options.clip_grad_norm
        self._replicas = frozenset(id(p) for p in options.clip_norm_replicas)  # counted by another rank's norm
        self._hooks: list[Any] = []
        self._calls = 0  # step() calls: the pass index within the accumulation window
        self._no_sync = False
        self._synced = False  # synchronize() already ran for this step
        # parameters averaged elsewhere (a MoE layer's experts: comm/param_comm.py), one reducer per communicator
        plain, elsewhere = split_by_comm((p, p) for p in params)
        self.reducer = GradientReducer(comm, plain, options.op, Compression.of(options.compression),
                                       options.bucket_bytes, lambda: self._sync_pass)
        self.expert_reducers = [GradientReducer(mark.comm, ps, ReduceOp.SUM, Compression.of(options.compression),
                                                options.bucket_bytes, lambda: self._sync_pass, mark.divide_by)
                                for mark, ps in elsewhere]
        self._hooks += self.reducer.hooks + [h for r in self.expert_reducers for h in r.hooks]
        self.masters: Masters | None = None  # prepare(precision="bf16-master"): what the optimizer steps (masters.py)

    def use_masters(self, dtype: torch.dtype) -> None:
        """Step ``dtype`` copies of the parameters from now on (after the reducers hooked the parameters themselves:
        the gradients are averaged in the model's dtype)."""
        self.masters = Masters(self.optimizer, dtype)

    @property
    def buckets(self) -> list[Any]:
        """The fusion buckets, in launch order (their buffers persist between steps)."""
        return self.reducer.buckets

    def bucket_of(self, p: torch.Tensor) -> Any:
        """The bucket ``p``'s gradient travels in (None: not tracked)."""
        return self.reducer.bucket_of(p)

    def _added_param_group(self, group: dict[str, Any]) -> None:
        before = len(self.reducer.hooks)
        self.reducer.track([p for p in group["params"] if p.requires_grad and self.reducer.bucket_of(p) is None])
        self._hooks += self.reducer.hooks[before:]
        if self.masters is not None:
            self.masters.add_group(group)

    def synchronize(self) -> None:
        """Finish every bucket's allreduce (launching those whose gradients never all arrived) and write the
        averaged gradients into ``p.grad``. The next ``step()`` uses them as they are."""
        self._synced = True
        self.reducer.synchronize()
        for r in self.expert_reducers:
            r.synchronize()
        if self.masters is not None:
            self.masters.take_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; step()/zero_grad() inside do nothing."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def full_param(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s master copy where the precision keeps one (``masters.py``), else the parameter (copies)."""
        master = self.masters.master_of(param) if self.masters is not None else None
        return (master if master is not None else param).detach().clone()

    # ------------------------------------------------------------------ optimizer protocol (step_window.py)
    def _after_step(self) -> None:
        if self.masters is not None:
            self.masters.write_back()

    def _clear_grads(self, set_to_none: bool) -> None:
        super()._clear_grads(set_to_none)
        if self.masters is not None:
            self.masters.clear(set_to_none)

    def _clip(self, max_norm: float) -> torch.Tensor | float:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.expert_reducers:
            return self._clip_with_experts(params, max_norm)
        if self.options.clip_norm_group is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        grads = [p.grad for p in params if p.grad is not None]
        counted = [p.grad for p in params if p.grad is not None and id(p) not in self._replicas]
        local = torch.stack([g.float().pow(2).sum() for g in counted]).sum() if counted else torch.zeros(())
        return clip_summed(grads, local.cpu(), [self.options.clip_norm_group], max_norm)

    def _refuse_experts(self, what: str) -> None:
        """Ranks holding different experts do not hold the same model: an even slice per rank would mix them."""
        if self.expert_reducers:
            raise CheckpointError(f"{what} of a model with Mixture-of-Experts layers is not supported yet (each rank "
                                  "holds other experts); save the model's state_dict per rank yourself meanwhile")

    def fingerprint_parts(self, model: torch.nn.Module, rank: int, size: int
                          ) -> tuple[list[str], dict[str, tuple[int, torch.Tensor]]]:
        """Even slices of what every rank holds (refused with experts: see ``_refuse_experts``)."""
        self._refuse_experts("a training fingerprint (unidist verify)")
        return super().fingerprint_parts(model, rank, size)

    def _clip_with_experts(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """DeepSpeed's norm where ranks hold different experts (runtime/utils.py ``clip_grad_norm_``): each rank's
        norm over everything it holds, in float32, averaged over the data-parallel ranks; then the usual scale."""
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.stack([g.detach().float().norm(2) for g in grads]).pow(2).sum().float().pow(0.5) if grads \
            else torch.zeros(())
        total = self.dp.allreduce_((local / self.dp.size).reshape(1), "sum")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total[0]

    def checkpoint_layout(self, model: torch.nn.Module) -> Layout:
        """Every member of the data-parallel communicator holds the whole state: each writes an even slice."""
        if self.expert_reducers:  # each rank holds other experts: named by their index in the layer
            if self.masters is not None:
                raise CheckpointError("a checkpoint of a model with Mixture-of-Experts layers in precision "
                                      "'bf16-master' is not supported yet; use 'bf16-true' or 'bf16-mixed' there")
            return ExpertLayout(self.dp, model, self.optimizer)
        if self.masters is not None:
            return MastersLayout(self.dp.rank, self.dp.size, model, self.optimizer, world_ranks(self.dp), self.masters)
        return FullLayout(self.dp.rank, self.dp.size, model, self.optimizer, world_ranks(self.dp))

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """(parameters, gradients) this optimizer keeps beyond the model's own: the fusion buffers."""
        return [], [b for r in (self.reducer, *self.expert_reducers) for b in r.held_buffers()]

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, buckets={len(self.buckets)}, "
                f"op={self.op.value}, compression={self.compression}, k={self.backward_passes_per_step})")
