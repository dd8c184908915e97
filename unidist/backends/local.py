"""The local backend: one process, no launcher (``python script.py``)."""

from __future__ import annotations

from typing import Any

from unidist.registry import Backend, Launch, Strategy, register


def _manager() -> type[Any]:
    from unidist.managers.local import LocalManager

    return LocalManager


def unidist_training() -> Strategy:
    """unidist's own training (DistributedOptimizer, ZeRO): the strategy of every backend without an engine
    trainer of its own, and of backends registered outside unidist that name none."""
    from unidist.train.trainer import Trainer

    return Trainer


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
