"""OptimizerView: a real ``torch.optim.Optimizer`` whose parameter groups and state are another optimizer's.

What ``prepare`` returns must pass ``isinstance(opt, torch.optim.Optimizer)`` on every backend, because LR
schedulers check it, and edits to ``opt.param_groups`` (a scheduler setting ``lr`` or ``momentum``) must
reach the optimizer that actually steps: the user's, Horovod's wrapper, or a DeepSpeed engine's. So the view
holds no groups or state of its own: ``param_groups``, ``state`` and ``defaults`` read and write through to
the wrapped optimizer, even after it replaces its lists (``load_state_dict`` does). Subclasses decide what
``step`` and ``zero_grad`` do around the wrapped optimizer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from unidist.checkpoint.layout import even_slice
from unidist.errors import InvalidArgumentError
from unidist.train.fingerprint import slice_squares

__all__ = ["OptimizerView"]


class _Through:
    """A data descriptor for one attribute of the wrapped optimizer.

    ``torch.optim.Optimizer.__init__`` assigns ``defaults``, ``state`` and ``param_groups`` before the
    view knows its inner optimizer; those boot-time values are kept on the view and dropped once it does.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.boot = f"_boot_{name}"

    def __get__(self, view: Any, owner: type | None = None) -> Any:
        if view is None:
            return self
        inner = view.__dict__.get("_inner")
        return view.__dict__[self.boot] if inner is None else getattr(inner, self.name)

    def __set__(self, view: Any, value: Any) -> None:
        inner = view.__dict__.get("_inner")
        if inner is None:
            view.__dict__[self.boot] = value
        else:
            setattr(inner, self.name, value)


class OptimizerView(torch.optim.Optimizer):
    """Shares ``param_groups``, ``state`` and ``defaults`` with ``inner``; ``state_dict`` is inner's."""

    param_groups = _Through()  # type: ignore[assignment]
    state = _Through()  # type: ignore[assignment]
    defaults = _Through()  # type: ignore[assignment]

    def __init__(self, inner: Any) -> None:
        if not hasattr(inner, "param_groups"):
            raise InvalidArgumentError(f"expected an optimizer with param_groups, got {type(inner).__name__}")
        # The base initialiser gives the view its hook tables and step profiling; one empty group satisfies it.
        super().__init__([{"params": []}], {})
        self.__dict__["_inner"] = inner
        for name in ("param_groups", "state", "defaults"):
            self.__dict__.pop(f"_boot_{name}", None)

    @property
    def optimizer(self) -> Any:
        """The wrapped optimizer (as ``hvd.DistributedOptimizer`` and DeepSpeed engines name it)."""
        return self.__dict__["_inner"]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        return self.optimizer.step(closure)  # type: ignore[no-any-return]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "_inner" not in self.__dict__:  # torch.optim.Optimizer.__init__ adding the boot group
            super().add_param_group(param_group)
            return
        self.optimizer.add_param_group(param_group)
        self._added_param_group(self.optimizer.param_groups[-1])

    def _added_param_group(self, group: dict[str, Any]) -> None:
        """A subclass that must know every parameter (to average its gradient) hooks the new ones here."""
        raise InvalidArgumentError(
            f"add_param_group after prepare() is not supported by {type(self).__name__}; add the group to the "
            "optimizer before prepare()"
        )

    # rank 0's persistent buffers after every optimizer step (buffer_sync.py); prepare() sets it, a building-block
    # optimizer (distributed_optimizer) has none
    buffer_sync: Any = None

    # the training fingerprint (fingerprint.py) when prepare was asked for one
    fingerprint: Any = None

    def _end_step(self) -> None:
        """Called by every prepared optimizer at the end of each optimizer step (applied or skipped): rank 0's
        buffers everywhere, then the fingerprint's line for the step."""
        if self.buffer_sync is not None:
            self.buffer_sync.sync()
        if self.fingerprint is not None:
            grad_sq, partitioned = self.fingerprint_grad_sq(self.fingerprint.comm.rank, self.fingerprint.comm.size)
            self.fingerprint.record(grad_sq, partitioned, [g["lr"] for g in self.param_groups if "lr" in g],
                                    self.loss_scale, self.last_step_skipped)

    @property
    def clipping(self) -> float | None:
        """The gradient-norm clipping in effect (an engine's own included), or None."""
        return getattr(self, "clip_grad_norm", None)

    def fingerprint_grad_sq(self, rank: int, size: int) -> tuple[float, bool]:
        """(this rank's part of the squared global gradient norm before clipping, whether the ranks' parts are
        disjoint) at the end of a step, for the fingerprint (``rank``, ``size``: its data-parallel communicator's):
        inf for a skipped step, the clip's own measure where it clipped, else ``_fingerprint_grads``."""
        if self.last_step_skipped:
            return math.inf, False
        norm = getattr(self, "last_grad_norm", None)
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

    # fp16's loss scale, the same report from every prepared optimizer: a LossScaler (train/precision.py) or
    # DeepSpeed's AgreedGradScaler (engines/deepspeed/scaler.py), both with scale_value, last_step_skipped,
    # skipped_steps
    scaler: Any = None

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self.scaler.scale_value if self.scaler is not None else 1.0  # type: ignore[no-any-return]

    @property
    def last_step_skipped(self) -> bool:
        """The last step found inf/nan gradients and was not applied (decided alike on every rank)."""
        return self.scaler is not None and bool(self.scaler.last_step_skipped)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/nan gradients so far (the same count on every rank)."""
        return int(self.scaler.skipped_steps) if self.scaler is not None else 0

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} is bound to a running job and cannot be pickled; save "
                        "opt.state_dict() instead")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
