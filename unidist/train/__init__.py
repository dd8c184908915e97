"""The training layer, written once on unidist.comm: data-parallel optimizer, ZeRO, precision, state broadcast,
sampler, and unidist's own Trainer behind ``Manager.prepare`` (engines with a trainer of their own keep it in their
package, unidist/engines/<name>/trainer.py, built on this one).
Nothing below this layer imports it."""

from __future__ import annotations

from unidist.train.ddp import DistributedOptimizer
from unidist.train.preempt import Preemption
from unidist.train.sampler import ShardSampler
from unidist.train.trainer import Trainer
from unidist.train.view import OptimizerView

__all__ = ["DistributedOptimizer", "OptimizerView", "Preemption", "ShardSampler", "Trainer"]

