"""The deepspeed backend: deepspeed.comm for collectives, DeepSpeed's engine (and its ZeRO) behind prepare."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.engines.torch.record import torch_like_calls, torch_like_mean, torch_like_p2p
from unidist.registry import Backend, Launch, Strategy, register


def _manager() -> type[Any]:
    from unidist.engines.deepspeed.manager import DeepSpeedManager

    return DeepSpeedManager


def _strategy() -> Strategy:
    from unidist.engines.deepspeed.trainer import DeepSpeedTrainer

    return DeepSpeedTrainer


def _raw_calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    import deepspeed.comm as ds_comm

    return torch_like_calls(ds_comm, mgr.size)


def _raw_grad_mean(mgr: Any) -> Callable[[Any], None]:
    import deepspeed.comm as ds_comm

    return torch_like_mean(ds_comm, mgr.size)


def _raw_p2p(mgr: Any) -> dict[str, tuple[Callable[[Any, int], Any], Callable[[Any, int], Any]]]:
    """deepspeed.comm has no send/recv of its own worth timing: torch.distributed's, which it runs on."""
    import torch.distributed as dist

    return torch_like_p2p(dist)


def _raw_engine(mgr: Any, model: Any, optimizer: Any, zero_stage: int, precision: str) -> Any:
    """``deepspeed.initialize`` with exactly the config ``prepare`` would give DeepSpeed for this stage."""
    import deepspeed

    from unidist.config import Config
    from unidist.engines.deepspeed.config import build
    from unidist.request import PrepareRequest

    opts = PrepareRequest.build(Config(), {"zero_stage": zero_stage, "precision": precision})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=build(opts, mgr.size, None))
    return engine


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
    raw_engine=_raw_engine,
    raw_p2p=_raw_p2p,
    raw_engine_column="ds",
    engine_reducer="DeepSpeed engine's allreduce",
    algorithms={"*": "gloo"},  # torch.distributed's gloo (the CPU accelerator)
    env_prefixes=("DS_", "GLOO_", "NCCL_", "TORCH_"),
    launches=(Launch("deepspeed", "deepspeed-{n}", (2,), cpu_env={"DS_ACCELERATOR": "cpu"}, bench="deepspeed"),),
))
