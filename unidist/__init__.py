"""unidist: one PyTorch training script, every launcher (python, mpiexec, horovodrun, deepspeed, torchrun).

Importing this package is cheap and starts nothing: no engine (mpi4py, horovod, deepspeed) and not even
torch is imported until a Manager is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import unidist.engines  # noqa: F401  (registers the built-in backends: records only, no engine imported)
from unidist import registry
from unidist.config import Config
from unidist.errors import (
    BackendUnavailableError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointMissingError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    EngineMismatchError,
    HostsError,
    InvalidArgumentError,
    LaunchEnvironmentError,
    MessageMismatchError,
    NotInitializedError,
    PeerLostError,
    UnidistError,
)
from unidist.launch import LaunchInfo, detect, script_args
from unidist.ops import ReduceOp

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointMissingError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Config",
    "ConfigError",
    "DeepSpeedManager",
    "EngineMismatchError",
    "HorovodManager",
    "HostsError",
    "InvalidArgumentError",
    "LaunchEnvironmentError",
    "LaunchInfo",
    "LocalManager",
    "MPIManager",
    "Manager",
    "MessageMismatchError",
    "NotInitializedError",
    "PeerLostError",
    "ReduceOp",
    "TorchManager",
    "UnidistError",
    "__version__",
    "detect",
    "get_manager",
    "init",
    "script_args",
]

def init(config: Config | None = None, *, backend: str | None = None,
         environ: Mapping[str, str] | None = None) -> Manager:
    """The Manager this process should use, not yet started: ``with unidist.init() as mgr:``.

    ``backend`` overrides UNIDIST_BACKEND and detection; ``environ`` defaults to ``os.environ``.
    """
    from unidist.selector import create

    config = config if config is not None else Config.from_env(environ)
    if backend is not None:
        config = dataclasses.replace(config, backend=backend)
    return create(config, detect(environ))


def __getattr__(name: str) -> Any:
    """The Manager classes, imported on first use (``unidist.MPIManager``): each backend's record names its own."""
    if name in ("Manager", "get_manager"):
        from unidist.managers import base

        return getattr(base, name)
    for record in registry.records():
        if record.manager_name == name:
            return record.manager()
    raise AttributeError(f"module 'unidist' has no attribute {name!r}")
