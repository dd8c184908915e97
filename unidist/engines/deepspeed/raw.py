"""deepspeed.comm's own calls and DeepSpeed's own training engine, for the benchmarks' raw columns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.engines.torch.raw import torch_like_calls, torch_like_mean, torch_like_p2p
from unidist.registry import RawEngine


def _calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    import deepspeed.comm as ds_comm

    return torch_like_calls(ds_comm, mgr.size)


def _grad_mean(mgr: Any) -> Callable[[Any], None]:
    import deepspeed.comm as ds_comm

    return torch_like_mean(ds_comm, mgr.size)


def _p2p(mgr: Any) -> dict[str, tuple[Callable[[Any, int], Any], Callable[[Any, int], Any]]]:
    """deepspeed.comm has no send/recv of its own worth timing: torch.distributed's, which it runs on."""
    import torch.distributed as dist

    return torch_like_p2p(dist)


def _trainer(mgr: Any, model: Any, optimizer: Any, zero_stage: int, precision: str) -> Any:
    """``deepspeed.initialize`` with exactly the config ``prepare`` would give DeepSpeed for this stage."""
    import deepspeed

    from unidist.config import Config
    from unidist.engines.deepspeed.config import build
    from unidist.request import PrepareRequest

    opts = PrepareRequest.build(Config(), {"zero_stage": zero_stage, "precision": precision})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=build(opts, mgr.size, None))
    return engine


def _start() -> Callable[[], None]:
    """DeepSpeed as its scripts start it: ``deepspeed.init_distributed()`` under its launcher."""
    import deepspeed
    import torch.distributed as dist

    cuda = deepspeed.get_accelerator().device_name() == "cuda"
    compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
    if not cuda and isinstance(compatible, dict):  # as unidist's start does: skip the shm op's JIT build (minutes,
        compatible["deepspeed_shm_comm"] = False  # once per machine), which only DeepSpeed's inference needs
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    dist.barrier()
    return dist.destroy_process_group


RAW = RawEngine(
    api="deepspeed.comm",
    calls=_calls,
    grad_mean=_grad_mean,
    trainer=_trainer,
    p2p=_p2p,
    trainer_column="ds",
    start=_start,
    reducer="DeepSpeed engine's allreduce",
    algorithms={"*": "gloo"},  # torch.distributed's gloo (the CPU accelerator)
)
