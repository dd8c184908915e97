"""The deepspeed backend: deepspeed.comm for collectives, DeepSpeed's engine (and its ZeRO) behind prepare."""

from __future__ import annotations

from typing import Any

from unidist.engines.deepspeed.raw import RAW
from unidist.registry import Backend, Launch, Strategy, register


def _manager() -> type[Any]:
    from unidist.engines.deepspeed.manager import DeepSpeedManager

    return DeepSpeedManager


def _strategy() -> Strategy:
    from unidist.engines.deepspeed.trainer import DeepSpeedTrainer

    return DeepSpeedTrainer


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
    env_prefixes=("DS_", "GLOO_", "NCCL_", "TORCH_"),
    raw=RAW,
    launches=(Launch("deepspeed", "deepspeed-{n}", (2,), cpu_env={"DS_ACCELERATOR": "cpu"}, bench="deepspeed"),),
))
