"""``deepspeed.utils.safe_get_full_fp32_param``, ``safe_get_full_grad``, ``safe_get_full_optimizer_state``: a
parameter's full value, averaged gradient or optimizer state, whatever ZeRO stage holds it
(ds/utils/tensor_fragment.py).

Every rank calls them (under ZeRO they gather). The parameter must belong to a model ``deepspeed.initialize``
prepared; DeepSpeed returns None for one it does not manage, and so do these. ``safe_get_full_grad`` reads the
gradient between ``backward`` and ``step`` (the reduced one: the reduction is finished first; ZeRO's shards are
gathered). Under the deepspeed backend DeepSpeed's own helpers answer (its engine holds the state).
"""

from __future__ import annotations

from typing import Any

import torch

from unidist.compat.deepspeed import state
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state"]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full parameter in float32 (a copy), or None for a parameter no engine manages.

    Args:
        param: a parameter of a model ``initialize`` prepared.
    """
    engine = state.engine_of([param])
    if engine is None:
        return None
    if engine.manager.backend == "deepspeed":
        return engine.manager.engine_api.utils.safe_get_full_fp32_param(param)  # type: ignore[no-any-return]
    with engine.manager.gathered_parameters(engine.prepared_model):
        return param.detach().float().clone()


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full averaged gradient in float32 (a copy) between ``backward`` and ``step``; None without one.

    Args:
        param: a parameter of a model ``initialize`` prepared.
    """
    engine = state.engine_of([param])
    if engine is None:
        return None
    if engine.manager.backend == "deepspeed":  # DeepSpeed's engine holds it: its own helper reads it
        return engine.manager.engine_api.utils.safe_get_full_grad(param)  # type: ignore[no-any-return]
    grad = engine.optimizer.full_grad(param) if engine.optimizer is not None else param.grad
    return None if grad is None else grad.detach().float().clone()


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"`` ...) of ``param`` in float32;
    None where there is none (no engine, no optimizer, no such state yet).

    Args:
        param: a parameter of a model ``initialize`` prepared. optim_state_key: the state's name.
    """
    engine = state.engine_of([param])
    if engine is None or engine.optimizer is None:
        return None
    if engine.manager.backend == "deepspeed":
        return engine.manager.engine_api.utils.safe_get_full_optimizer_state(  # type: ignore[no-any-return]
            param, optim_state_key)
    full: dict[str, Any] = engine.manager.full_optimizer_state_dict(engine.optimizer)
    index = _index(engine, param)
    value = full.get("state", {}).get(index, {}).get(optim_state_key)
    return value.detach().float().clone() if isinstance(value, torch.Tensor) else None


def _index(engine: Any, param: torch.nn.Parameter) -> int:
    """``param``'s index in the optimizer's state dict (param groups in order, as torch numbers them)."""
    i = 0
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            if p is param:
                return i
            i += 1
    named = dict(engine.module.named_parameters())
    position = next((k for k, (n, p) in enumerate(named.items()) if p is param), None)
    if position is None:
        raise DeepSpeedUnsupportedError("safe_get_full_optimizer_state: the parameter is not in the engine's optimizer")
    return position
