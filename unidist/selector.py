"""Selection: which backend a launched process uses, and its Manager made with its training strategy.

The backends themselves are records in ``unidist.registry`` (unidist's own in ``unidist/engines/``); this
module only reads them: ``UNIDIST_BACKEND`` if set, else the backend the launcher family implies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from unidist import registry
from unidist.config import Config
from unidist.errors import BackendUnavailableError
from unidist.launch import LaunchInfo, detect

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["backend_for", "create", "select"]


def backend_for(config: Config, launch: LaunchInfo) -> str:
    """The backend name: UNIDIST_BACKEND if set, else what the launcher implies."""
    if config.backend is not None:
        return registry.get(config.backend).name
    return registry.for_launcher(launch.launcher)


def _record(config: Config, launch: LaunchInfo) -> registry.Backend:
    chosen = registry.get(backend_for(config, launch))
    missing = chosen.missing()
    if missing:
        raise BackendUnavailableError(
            f"the {chosen.name!r} backend needs {', '.join(missing)}, which is not installed; {chosen.install}"
        )
    return chosen


def select(config: Config | None = None, launch: LaunchInfo | None = None,
           environ: Mapping[str, str] | None = None) -> type[Manager]:
    """The Manager class for this process, imported now; a missing engine raises BackendUnavailableError."""
    config = config if config is not None else Config.from_env(environ)
    launch = launch if launch is not None else detect(environ)
    cls: type[Manager] = _record(config, launch).manager()
    return cls


def create(config: Config | None = None, launch: LaunchInfo | None = None,
           environ: Mapping[str, str] | None = None) -> Manager:
    """The Manager for this process, not yet started, handed the call that gives its backend's training strategy
    (made at the first ``prepare``: init imports no training layer)."""
    config = config if config is not None else Config.from_env(environ)
    launch = launch if launch is not None else detect(environ)
    chosen = _record(config, launch)
    manager: Manager = chosen.manager()(config, launch, strategy=chosen.strategy)
    return manager
