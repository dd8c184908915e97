"""What Horovod's two optimizers (``optimizer.py``, ``adasum_optimizer.py``) check and refuse, written once:
their ``named_parameters`` checks and the messages of their ``OptimizerProtocolError``s, in Horovod's words."""

from __future__ import annotations

from typing import Any

from unidist.errors import InvalidArgumentError

__all__ = ["TOO_MANY_PASSES", "ZERO_GRAD_MID_STEP", "check_named_parameters"]

ZERO_GRAD_MID_STEP = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                      "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")


def check_named_parameters(named: list[Any], param_groups: list[dict[str, Any]]) -> None:
    """Horovod's checks of ``named_parameters``: tuples, unique names, every optimizer parameter named."""
    if any(not isinstance(p, tuple) for p in named):
        raise InvalidArgumentError("named_parameters should be a sequence of tuples (name, parameter), usually "
                                   "produced by model.named_parameters().")
    names = [k for k, _ in named]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise InvalidArgumentError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                                   f"{', '.join(dups)}")
    unnamed = {id(v) for g in param_groups for v in g["params"]} - {id(v) for _, v in named}
    if unnamed:
        raise InvalidArgumentError("named_parameters was specified, but one or more model parameters were not "
                                   f"named. Python object ids: {', '.join(str(i) for i in unnamed)}")
