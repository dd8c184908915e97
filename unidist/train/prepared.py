"""``Prepared``: the base of every prepared optimizer, what the trainer, the checkpoints and the fingerprint read.

Every engine's prepared optimizer (unidist's ``WindowedOptimizer`` family, DeepSpeed's ``EngineOptimizer``, Horovod's
``HorovodOptimizer``) is an ``OptimizerView`` (a real torch Optimizer whose groups and state are another's) that
honours ``unidist.prepared.PreparedOptimizer`` (what the user reads) and this class's part: its checkpoint layout,
its fingerprint parts, the hooks it holds, the fp16 loss scaler it reports, and its step observers. Whatever must
happen at the end of each optimizer step (rank 0's buffers everywhere, the fingerprint's line) is an observer the
trainer attaches with ``observe``, called by ``_begin_step`` / ``_end_step``; nothing is set on the optimizer from
outside.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Protocol

import torch

from unidist.checkpoint.layout import Layout, even_slice
from unidist.errors import InvalidArgumentError
from unidist.prepared import PreparedOptimizer
from unidist.train.fingerprint import slice_squares
from unidist.train.view import OptimizerView

__all__ = ["LossScaling", "Prepared", "StepObserver", "one_way_to_accumulate"]


def one_way_to_accumulate(k: int, name: str = "backward_passes_per_step") -> None:
    """``accumulate()`` blocks and a window of k backward passes per step are two ways to accumulate; one prepared
    optimizer takes one of them (the window would count the block's passes as its own)."""
    if k > 1:
        raise InvalidArgumentError(f"accumulate() with {name}={k}: use one of the two ways to accumulate, "
                                   f"accumulate() blocks or {name}, not both")


class LossScaling(Protocol):
    """fp16's loss scale as every prepared optimizer reports it: a LossScaler (train/precision.py) or DeepSpeed's
    AgreedGradScaler (engines/deepspeed/scaler.py)."""

    @property
    def scale_value(self) -> float: ...

    @property
    def last_step_skipped(self) -> bool: ...

    @property
    def skipped_steps(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


class StepObserver(Protocol):
    """What must happen around each optimizer step of a prepared optimizer, applied or skipped."""

    def before_step(self, opt: Prepared) -> None:
        """The gradients are reduced (and unscaled), not yet clipped nor stepped."""

    def after_step(self, opt: Prepared) -> None:
        """The step is over (or was skipped)."""


class Prepared(OptimizerView, PreparedOptimizer):
    """See the module docstring. Subclasses set ``clip_grad_norm`` and ``_passes`` (or override the properties that
    read them), implement ``synchronize``, ``accumulate``, ``checkpoint_layout`` and ``remove_hooks``, and call
    ``_begin_step`` and ``_end_step`` around each optimizer step."""

    clip_grad_norm: float | None = None
    _passes = 1  # the accumulation window
    # the global L2 norm the last clip measured (before clipping), as the clip returned it (a 0-d tensor on the
    # gradients' device for DDP: the step never waits for the device; ``last_grad_norm`` converts when read)
    _grad_norm: torch.Tensor | float | None = None
    scaler: LossScaling | None = None  # fp16 dynamic loss scaling (prepare(precision="fp16-mixed"))

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self._observers: list[StepObserver] = []

    # ----------------------------------------------------------------- the user's part (PreparedOptimizer)
    @property
    def zero_stage(self) -> int:
        return 0

    @property
    def backward_passes_per_step(self) -> int:
        return self._passes

    @property
    def clipping(self) -> float | None:
        return self.clip_grad_norm

    @property
    def last_grad_norm(self) -> float | None:
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale_value if self.scaler is not None else 1.0

    @property
    def last_step_skipped(self) -> bool:
        return self.scaler is not None and bool(self.scaler.last_step_skipped)

    @property
    def skipped_steps(self) -> int:
        return int(self.scaler.skipped_steps) if self.scaler is not None else 0

    # ----------------------------------------------------------------- step observers
    def observe(self, observer: StepObserver) -> None:
        """Call ``observer`` around every optimizer step from now on (the trainer's buffer sync and fingerprint)."""
        self._observers.append(observer)

    def _begin_step(self) -> None:
        for observer in self._observers:
            observer.before_step(self)

    def _end_step(self) -> None:
        for observer in self._observers:
            observer.after_step(self)

    # ----------------------------------------------------------------- what the trainer and checkpoints read
    @abc.abstractmethod
    def checkpoint_layout(self, model: torch.nn.Module) -> Layout:
        """What this rank holds of ``model`` and of the optimizer state, for unidist.checkpoint."""

    @abc.abstractmethod
    def remove_hooks(self) -> None:
        """Detach every hook this optimizer holds (its gradient hooks, the precision's forward hooks)."""

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s whole averaged gradient (a copy) between ``backward`` and ``step``, on every rank; the
        reduction is finished first (``synchronize``). Here every rank holds it; ZeRO gathers its shards.

        Args:
            param: a parameter of the prepared model.
        """
        self.synchronize()
        grad = param.grad
        return None if grad is None else grad.detach().clone()

    def full_param(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s whole value as the optimizer steps it (a copy, on every rank): here the parameter itself;
        its float32 master copy where the precision keeps one; ZeRO gathers its shards.

        Args:
            param: a parameter of the prepared model.
        """
        return param.detach().clone()

    # ----------------------------------------------------------------- what the fingerprint reads
    def hold_gradient_norm(self, rank: int, size: int) -> None:
        """Before the step: keep what ``fingerprint_grad_sq`` needs where the step consumes it (DeepSpeed's engine
        clears its gradients in its step); nothing here, where the gradients outlive the step."""

    def fingerprint_grad_sq(self, rank: int, size: int) -> tuple[float, bool]:
        """(this rank's part of the squared global gradient norm before clipping, whether the ranks' parts are
        disjoint) at the end of a step (``rank``, ``size``: its data-parallel communicator's): inf for a skipped
        step, the clip's own measure where it clipped, else ``_fingerprint_grads``."""
        if self.last_step_skipped:
            return math.inf, False
        norm = self.last_grad_norm
        if self.clipping is not None and norm is not None:
            return float(norm) ** 2, False
        return self._fingerprint_grads(rank, size)

    def _fingerprint_grads(self, rank: int, size: int) -> tuple[float, bool]:
        """``fingerprint_grad_sq`` where nothing measured the norm: here every rank holds the whole averaged
        gradient, and sums the squares of its even slice (ZeRO and DeepSpeed's engine override this)."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return slice_squares(grads, rank, size), True

    def fingerprint_parts(self, model: torch.nn.Module, rank: int, size: int
                          ) -> tuple[list[str], dict[str, tuple[int, torch.Tensor]]]:
        """Every state-dict entry's name and this rank's part of it for the fingerprint: views read before the next
        step, and no collective. Here every rank holds the model whole: even slices."""
        state = model.state_dict(keep_vars=True)
        return list(state), {k: even_slice(v, rank, size, copy=False) for k, v in state.items()}
