"""The training layer, written once on unidist.comm: data-parallel optimizer, state broadcast, sampler, and
the per-engine trainers behind ``Manager.prepare``. Nothing below this layer imports it."""

from __future__ import annotations

from typing import Any

from unidist.train.ddp import DistributedOptimizer
from unidist.train.sampler import ShardSampler
from unidist.train.trainer import Trainer
from unidist.train.view import OptimizerView

__all__ = ["DistributedOptimizer", "OptimizerView", "ShardSampler", "Trainer", "trainer_for"]


def trainer_for(manager: Any) -> Trainer:
    """The Trainer for ``manager``'s backend: the engine's own training where it has one."""
    if manager.name == "deepspeed":
        from unidist.train.deepspeed import DeepSpeedTrainer

        return DeepSpeedTrainer(manager)
    if manager.name == "horovod":
        from unidist.train.horovod import HorovodTrainer

        return HorovodTrainer(manager)
    return Trainer(manager)
