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

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state"]


def _managing(param: torch.nn.Parameter) -> tuple[Any, Any]:
    """(the engine whose model holds ``param`` or None, DeepSpeed's own ``deepspeed.utils`` where that engine is
    DeepSpeed's: its engine holds the state, so its helpers answer)."""
    engine = state.engine_of([param])
    if engine is None or engine.manager.backend != "deepspeed":
        return engine, None
    return engine, engine.manager.engine_api.utils


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full parameter in float32 (a copy), or None for a parameter no engine manages.

    Args:
        param: a parameter of a model ``initialize`` prepared.
    """
    engine, theirs = _managing(param)
    if theirs is not None:
        return theirs.safe_get_full_fp32_param(param)  # type: ignore[no-any-return]
    if engine is None:
        return None
    if engine.optimizer is not None:  # the value the optimizer steps: the master copy under bf16 (ZeRO gathers)
        full: torch.Tensor = engine.optimizer.full_param(param)
        return full.float()
    with engine.manager.gathered_parameters(engine.prepared_model):
        return param.detach().float().clone()


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full averaged gradient in float32 (a copy) between ``backward`` and ``step``; None without one.

    Args:
        param: a parameter of a model ``initialize`` prepared.
    """
    engine, theirs = _managing(param)
    if theirs is not None:
        return theirs.safe_get_full_grad(param)  # type: ignore[no-any-return]
    if engine is None:
        return None
    grad = engine.optimizer.full_grad(param) if engine.optimizer is not None else param.grad
    return None if grad is None else grad.detach().float().clone()


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"`` ...) of ``param`` in float32;
    None where there is none (no engine, no optimizer, a parameter it does not step, no such state yet).

    Args:
        param: a parameter of a model ``initialize`` prepared. optim_state_key: the state's name.
    """
    engine, theirs = _managing(param)
    if theirs is not None:
        return theirs.safe_get_full_optimizer_state(param, optim_state_key)  # type: ignore[no-any-return]
    if engine is None or engine.optimizer is None:
        return None
    index = next((i for i, p in enumerate(engine.stepped_params) if p is param), None)
    full: dict[str, Any] = engine.manager.full_optimizer_state_dict(engine.optimizer)  # every rank: a collective
    value = full.get("state", {}).get(index, {}).get(optim_state_key) if index is not None else None
    return value.detach().float().clone() if isinstance(value, torch.Tensor) else None
