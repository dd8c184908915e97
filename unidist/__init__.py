"""unidist: one PyTorch training script, every launcher (python, mpiexec, horovodrun, deepspeed, torchrun).

Importing this package is cheap and starts nothing: no engine (mpi4py, horovod, deepspeed) and not even
torch is imported until a Manager is used.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from unidist.config import Config
from unidist.errors import (
    BackendUnavailableError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    InvalidArgumentError,
    LaunchEnvironmentError,
    NotInitializedError,
    UnidistError,
)
from unidist.launch import LaunchInfo, detect, strip_local_rank_arg
from unidist.ops import ReduceOp

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__version__ = "0.1.0"

# The deepspeed launcher appends --local_rank=N to the script's arguments; drop it before user argparse runs.
strip_local_rank_arg(sys.argv)

__all__ = [
    "BackendUnavailableError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Config",
    "ConfigError",
    "DeepSpeedManager",
    "HorovodManager",
    "InvalidArgumentError",
    "LaunchEnvironmentError",
    "LaunchInfo",
    "LocalManager",
    "MPIManager",
    "Manager",
    "NotInitializedError",
    "ReduceOp",
    "TorchManager",
    "UnidistError",
    "__version__",
    "detect",
    "get_manager",
    "init",
]

_LAZY = {
    "Manager": "unidist.managers.base",
    "get_manager": "unidist.managers.base",
    "LocalManager": "unidist.managers.local",
    "MPIManager": "unidist.managers.mpi",
    "HorovodManager": "unidist.managers.horovod",
    "DeepSpeedManager": "unidist.managers.deepspeed",
    "TorchManager": "unidist.managers.torch",
}


def init(config: Config | None = None, *, backend: str | None = None,
         environ: Mapping[str, str] | None = None) -> Manager:
    """The Manager this process should use, not yet started: ``with unidist.init() as mgr:``.

    ``backend`` overrides UNIDIST_BACKEND and detection; ``environ`` defaults to ``os.environ``.
    """
    from unidist.selector import select

    config = config if config is not None else Config.from_env(environ)
    if backend is not None:
        config = dataclasses.replace(config, backend=backend)
    launch = detect(environ)
    return select(config, launch)(config, launch)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unidist' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
