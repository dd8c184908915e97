"""The loop contract shared by unidist's own optimizers (DistributedOptimizer, ZeroOptimizer).

The uniform loop calls ``step()`` and ``zero_grad()`` after every backward, as with a DeepSpeed engine. With
``backward_passes_per_step=k`` they act on every k-th call (the end of the accumulation window) and gradients
accumulate locally in between. ``synchronize()`` may be called before ``step()`` (to read or clip the reduced
gradients); ``step()`` then does not reduce again.

Under fp16 loss scaling (``scaler``) the window's last step unscales the reduced gradients first; if any is
inf or nan — decided the same on every rank (``_agree_found_inf``) — nothing is clipped or stepped, and the
scale backs off. ``last_step_skipped``, ``skipped_steps`` and ``loss_scale`` report it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from unidist.comm import trace_hooks
from unidist.errors import InvalidArgumentError
from unidist.train.precision import LossScaler
from unidist.train.prepared import Prepared, one_way_to_accumulate

__all__ = ["WindowedOptimizer", "clip_summed"]


def clip_summed(grads: list[torch.Tensor], local: torch.Tensor, comms: list[Any], max_norm: float) -> float:
    """Clip ``grads`` to the global L2 norm ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` on one process:
    ``local`` is this rank's sum of squares, summed over each of ``comms`` in turn (ZeRO's shards over the
    data-parallel ranks, a pipeline's stages over its stage group). Returns the norm before clipping."""
    total = local.reshape(1).double().clone()  # reduced in place, over each communicator in turn
    for comm in comms:
        comm.allreduce_(total, "sum")
    norm = float(total.sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


class WindowedOptimizer(Prepared):
    """Subclasses reduce gradients in ``synchronize``, clip them in ``_clip`` and may share updated
    parameters in ``_after_step``."""

    _calls = 0  # step() calls: the pass index within the accumulation window
    _synced = False  # synchronize() already ran for this step
    _no_sync = False  # inside no_sync(): nothing reduces, steps or clears
    _hooks: list[Any]
    scaler: LossScaler | None = None  # fp16 dynamic loss scaling (prepare(precision="fp16-mixed"))

    @property
    def _sync_pass(self) -> bool:
        k = self.backward_passes_per_step
        return not self._no_sync and self._calls % k == k - 1

    def synchronize(self) -> None:
        raise NotImplementedError

    def _clip(self, max_norm: float) -> torch.Tensor | float:
        """Clip the reduced gradients to ``max_norm``; returns their global L2 norm before clipping."""
        raise NotImplementedError

    def _scaled_grads(self) -> list[torch.Tensor]:
        """The gradients the step uses, still multiplied by the loss scale (unscaled in place)."""
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _agree_found_inf(self, found: torch.Tensor) -> torch.Tensor:
        """The skip decision every rank makes. The default: every rank holds the same reduced gradients, so each
        finds the same; ZeRO, whose ranks check only their shard, agrees with one collective."""
        return found

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """One optimizer step's micro-batches (``Manager.accumulate``): backward passes inside add their
        gradients locally and communicate nothing; leaving the block reduces everything once; then ``step()``."""
        one_way_to_accumulate(self.backward_passes_per_step)
        if self._no_sync:
            raise InvalidArgumentError("accumulate() blocks do not nest (nor go inside no_sync())")
        self._no_sync = True
        self._hold(True)
        try:
            yield
        finally:
            self._no_sync = False
            self._hold(False)
        self.synchronize()  # not after an exception: that rank is failing, and its peers are told so

    def _hold(self, on: bool) -> None:
        """Keep (``on``) or stop keeping what the forward would otherwise fetch each time (ZeRO-3's parameters)."""

    def _before_step(self) -> None:
        """Just before the wrapped optimizer's step (ZeRO keeps the slices of unused parameters here)."""

    def _after_step(self) -> None:
        """After the wrapped optimizer's step (ZeRO shares the updated shards here)."""

    def _clear_grads(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """On the window's last pass: reduce (unless synchronize() did), clip, step. Otherwise nothing."""
        if closure is not None:
            raise InvalidArgumentError(f"{type(self).__name__}.step takes no closure (the loss must be computed "
                                       "before gradients are reduced)")
        if self._no_sync:
            return None
        sync = self._sync_pass
        self._calls += 1
        if not sync:
            return None
        if trace_hooks.active:  # the timeline (off, this bool test is all it costs)
            with trace_hooks.span("step"):
                self._step()
        else:
            self._step()
        return None

    def _step(self) -> None:
        """The window's last pass: reduce (unless synchronize() did), unscale and agree on a skip, clip, step."""
        if not self._synced:
            self.synchronize()
        self._synced = False
        found = None if self.scaler is None else self._agree_found_inf(self.scaler.unscale(self._scaled_grads()))
        self._begin_step()
        if found is None or not bool(found):  # no loss scaling, or no inf/nan anywhere
            if self.clip_grad_norm is not None:
                self._grad_norm = self._clip(self.clip_grad_norm)
            self._before_step()
            self.optimizer.step()
            self._after_step()
        if self.scaler is not None and found is not None:
            self.scaler.update(found)
        self._end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients after a step; between accumulation passes it keeps them."""
        if self._no_sync or self._calls % self.backward_passes_per_step != 0:
            return
        self._clear_grads(set_to_none)

    def attach_hooks(self, hooks: list[Any]) -> None:
        """Hooks ``remove_hooks()`` detaches too (the precision's forward hooks on the user's module)."""
        self._hooks += hooks

    def remove_hooks(self) -> None:
        """Detach the gradient (and module) hooks: the optimizer stops reducing anything."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
