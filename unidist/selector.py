"""Backend registry and selection: which Manager a launched process should use.

Factories are registered by module path so that nothing here imports an engine until ``select`` is asked
for that backend. The table also names each backend's trainer (the training layer behind ``Manager.prepare``)
and the checkpoint layer: the managers reach the layers built on them through these names, never by
importing them, so ``unidist.comm`` and ``unidist.managers`` stay below ``unidist.train``/``unidist.checkpoint``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unidist.config import Config
from unidist.errors import BackendUnavailableError, ConfigError
from unidist.launch import LaunchInfo, backend_of, detect

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["CHECKPOINT", "BackendSpec", "backend_for", "checkpoint_call", "load", "register", "registered",
           "select", "spec", "trainer_of", "unregister"]


@dataclass(frozen=True)
class BackendSpec:
    """Where a Manager lives and which packages it needs (checked before import, for a clear error)."""

    name: str
    target: str  # "module:ClassName"
    requires: tuple[str, ...]
    install: str
    trainer: str = "unidist.train.trainer:Trainer"  # "module:ClassName" behind Manager.prepare

    def missing(self) -> list[str]:
        return [pkg for pkg in self.requires if importlib.util.find_spec(pkg) is None]


_REGISTRY: dict[str, BackendSpec] = {}

def register(name: str, target: str, requires: tuple[str, ...] = (), install: str = "", *,
             trainer: str = BackendSpec.trainer, replace: bool = False) -> None:
    """Add a backend, importable later by name.

    Args:
        name: the value of ``UNIDIST_BACKEND`` that selects it.
        target: ``"package.module:ManagerClass"``, imported only when selected.
        requires: packages that must be importable (checked first, for a clear error).
        install: the command that installs them, shown when one is missing.
        trainer: ``"package.module:TrainerClass"`` behind ``prepare`` (default: unidist's own training).
        replace: allow replacing a backend already registered under ``name`` (refused otherwise, so a
            plugin cannot silently shadow a built-in backend).
    """
    if not name or not isinstance(name, str):
        raise ConfigError(f"a backend name must be a non-empty string, not {name!r}")
    old = _REGISTRY.get(name)
    if old is not None and not replace:
        raise ConfigError(f"a backend named {name!r} is already registered ({old.target}); pick another name, "
                          "or pass replace=True to replace it")
    _REGISTRY[name] = BackendSpec(name, target, requires, install, trainer)


def unregister(name: str) -> None:
    """Remove a backend (a no-op for an unknown name)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def spec(name: str) -> BackendSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        hint = ""
        if name in ("ray", "dask", "pymp", "pyseq"):
            hint = (" (that value is for Modin's unrelated 'unidist' package, which reads the same variable; "
                    "unset UNIDIST_BACKEND for this run)")
        raise ConfigError(
            f"UNIDIST_BACKEND={name!r} is not a registered backend; choose one of {', '.join(_REGISTRY)}{hint}"
        ) from None


def backend_for(config: Config, launch: LaunchInfo) -> str:
    """The backend name: UNIDIST_BACKEND if set, else what the launcher implies."""
    if config.backend is not None:
        return spec(config.backend).name
    return backend_of(launch.launcher)


def select(config: Config | None = None, launch: LaunchInfo | None = None,
           environ: Mapping[str, str] | None = None) -> type[Manager]:
    """The Manager class for this process, imported now; a missing engine raises BackendUnavailableError."""
    config = config if config is not None else Config.from_env(environ)
    launch = launch if launch is not None else detect(environ)
    chosen = spec(backend_for(config, launch))
    missing = chosen.missing()
    if missing:
        raise BackendUnavailableError(
            f"the {chosen.name!r} backend needs {', '.join(missing)}, which is not installed; {chosen.install}"
        )
    cls: type[Manager] = load(chosen.target)
    return cls


def load(target: str) -> Any:
    """The object a ``"package.module:name"`` target names, imported now."""
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def trainer_of(name: str) -> Any:
    """The Trainer class behind ``prepare`` for backend ``name`` (unidist's own for an unregistered one)."""
    chosen = _REGISTRY.get(name)
    return load(chosen.trainer if chosen is not None else BackendSpec.trainer)


def checkpoint_call(name: str) -> Any:
    """``save_checkpoint``, ``load_checkpoint`` or ``latest_checkpoint`` of the checkpoint layer."""
    return load(f"{CHECKPOINT}:{name}")


CHECKPOINT = "unidist.checkpoint"  # save/load/latest behind Manager.save_checkpoint & co., by name (see above)


# The install hints name the engines' own packages: PyPI's "unidist" is Modin's unrelated project.
register("local", "unidist.managers.local:LocalManager", ("torch",), "pip install torch")
register("mpi", "unidist.managers.mpi:MPIManager", ("torch", "mpi4py"),
         "pip install mpi4py mpich  (the mpich wheel provides mpiexec; on a cluster, build mpi4py against its MPI)")
register("torch", "unidist.managers.torch:TorchManager", ("torch",), "pip install torch")
register("deepspeed", "unidist.managers.deepspeed:DeepSpeedManager", ("torch", "deepspeed"), "pip install deepspeed",
         trainer="unidist.train.deepspeed:DeepSpeedTrainer")
register("horovod", "unidist.managers.horovod:HorovodManager", ("torch", "horovod"),
         "build it with `bash launch_scripts/install_horovod.sh` (0.28.1 needs a patched build for torch >= 2.1)",
         trainer="unidist.train.horovod:HorovodTrainer")
