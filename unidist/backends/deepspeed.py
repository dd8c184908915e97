"""The deepspeed backend: deepspeed.comm for collectives, DeepSpeed's engine (and its ZeRO) behind prepare."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.backends.torch import torch_like_calls, torch_like_mean
from unidist.registry import Backend, Launch, Strategy, register


def _manager() -> type[Any]:
    from unidist.managers.deepspeed import DeepSpeedManager

    return DeepSpeedManager


def _strategy() -> Strategy:
    from unidist.train.deepspeed import DeepSpeedTrainer

    return DeepSpeedTrainer


def _raw_calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    import deepspeed.comm as ds_comm

    return torch_like_calls(ds_comm, mgr.size)


def _raw_grad_mean(mgr: Any) -> Callable[[Any], None]:
    import deepspeed.comm as ds_comm

    return torch_like_mean(ds_comm, mgr.size)


BACKEND = register(Backend(
    name="deepspeed",
    manager_name="DeepSpeedManager",
    manager=_manager,
    strategy=_strategy,
    requires=("torch", "deepspeed"),
    install="from the unidist clone: pip install -c constraints.txt '.[deepspeed]' (the tested deepspeed; "
            "DS_ACCELERATOR=cpu on a machine without GPUs)",
    launcher="deepspeed",
    implied_by=("deepspeed",),
    engine="deepspeed.comm",
    raw_calls=_raw_calls,
    raw_grad_mean=_raw_grad_mean,
    launches=(Launch("deepspeed", "deepspeed-{n}", (2,), cpu_env={"DS_ACCELERATOR": "cpu"}, bench="deepspeed"),),
))
