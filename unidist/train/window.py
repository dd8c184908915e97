"""The loop contract shared by unidist's own optimizers (DistributedOptimizer, ZeroOptimizer).

The uniform loop calls ``step()`` and ``zero_grad()`` after every backward, as with a DeepSpeed engine. With
``backward_passes_per_step=k`` they act on every k-th call (the end of the accumulation window) and gradients
accumulate locally in between. ``synchronize()`` may be called before ``step()`` (to read or clip the reduced
gradients); ``step()`` then does not reduce again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.errors import InvalidArgumentError
from unidist.train.view import OptimizerView

__all__ = ["WindowedOptimizer"]


class WindowedOptimizer(OptimizerView):
    """Subclasses reduce gradients in ``synchronize``, clip them in ``_clip`` and may share updated
    parameters in ``_after_step``."""

    backward_passes_per_step: int = 1
    clip_grad_norm: float | None = None
    _calls = 0  # step() calls: the pass index within the accumulation window
    _synced = False  # synchronize() already ran for this step
    _no_sync = False  # inside no_sync(): nothing reduces, steps or clears
    _hooks: list[Any]

    @property
    def _sync_pass(self) -> bool:
        k = self.backward_passes_per_step
        return not self._no_sync and self._calls % k == k - 1

    def synchronize(self) -> None:
        raise NotImplementedError

    def _clip(self, max_norm: float) -> None:
        raise NotImplementedError

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
        if not self._synced:
            self.synchronize()
        self._synced = False
        if self.clip_grad_norm is not None:
            self._clip(self.clip_grad_norm)
        self.optimizer.step()
        self._after_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients after a step; between accumulation passes it keeps them."""
        if self._no_sync or self._calls % self.backward_passes_per_step != 0:
            return
        self._clear_grads(set_to_none)

    def remove_hooks(self) -> None:
        """Detach the gradient (and module) hooks: the optimizer stops reducing anything."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
