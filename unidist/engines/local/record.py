"""The local backend: one process, no launcher (``python script.py``)."""

from __future__ import annotations

from typing import Any

from unidist.engines.training import unidist_training
from unidist.registry import Backend, Launch, register


def _manager() -> type[Any]:
    from unidist.engines.local.manager import LocalManager

    return LocalManager


BACKEND = register(Backend(
    name="local",
    manager_name="LocalManager",
    manager=_manager,
    strategy=unidist_training,
    requires=("torch",),
    install="from the unidist clone: pip install -c constraints.txt torch (the tested CPU build; an unpinned torch can "
            "pull a CUDA build of several GB)",
    launcher=None,
    implied_by=("none",),
    launches=(Launch("none", "local-{n}", (1,)),),
))
