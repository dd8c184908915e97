"""The torch backend (torch.distributed): its registration (its own calls for the benchmarks are raw.py's)."""

from __future__ import annotations

from typing import Any

from unidist.engines.torch.raw import RAW
from unidist.engines.training import unidist_training
from unidist.registry import Backend, Launch, register


def _manager() -> type[Any]:
    from unidist.engines.torch.manager import TorchManager

    return TorchManager


BACKEND = register(Backend(
    name="torch",
    manager_name="TorchManager",
    manager=_manager,
    strategy=unidist_training,
    requires=("torch",),
    install="from the unidist clone: pip install -c constraints.txt torch (the tested CPU build; an unpinned torch can "
            "pull a CUDA build of several GB)",
    launcher="torchrun",
    implied_by=("torchrun", "env"),
    env_prefixes=("GLOO_", "NCCL_", "TORCH_"),
    raw=RAW,
    launches=(Launch("torchrun", "torchrun-{n}", (2,), bench="torch"),
              Launch("mpich", "torch-under-mpiexec-{n}", (3,), {"UNIDIST_BACKEND": "torch"})),
))
