"""OptimizerView: a real ``torch.optim.Optimizer`` whose parameter groups and state are another optimizer's.

What ``prepare`` returns must pass ``isinstance(opt, torch.optim.Optimizer)`` on every backend, because LR
schedulers check it, and edits to ``opt.param_groups`` (a scheduler setting ``lr`` or ``momentum``) must
reach the optimizer that actually steps: the user's, Horovod's wrapper, or a DeepSpeed engine's. So the view
holds no groups or state of its own: ``param_groups``, ``state`` and ``defaults`` read and write through to
the wrapped optimizer, even after it replaces its lists (``load_state_dict`` does). Subclasses decide what
``step`` and ``zero_grad`` do around the wrapped optimizer's; what a prepared optimizer adds to the view (its
contract, its observers, its loss scale) is ``unidist.train.prepared.Prepared``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unidist.errors import InvalidArgumentError

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

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} is bound to a running job and cannot be pickled; save "
                        "opt.state_dict() instead")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
