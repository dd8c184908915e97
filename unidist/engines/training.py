"""unidist's own training strategy (DistributedOptimizer, ZeRO, precision, accumulation on unidist.train): the one
every engine's record names unless the engine has a trainer of its own (DeepSpeed, Horovod)."""

from __future__ import annotations

from unidist.registry import Strategy


def unidist_training() -> Strategy:
    """unidist's own training (DistributedOptimizer, ZeRO): the strategy of every backend without an engine
    trainer of its own, and of backends registered outside unidist that name none."""
    from unidist.train.trainer import Trainer

    return Trainer
