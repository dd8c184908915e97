"""The training layer, written once on unidist.comm: data-parallel optimizer, state broadcast, sampler, and
the per-engine trainers behind ``Manager.prepare`` (named in the backend table, unidist/selector.py).
Nothing below this layer imports it."""

from __future__ import annotations

from unidist.train.ddp import DistributedOptimizer
from unidist.train.preempt import Preemption
from unidist.train.sampler import ShardSampler
from unidist.train.trainer import Trainer
from unidist.train.view import OptimizerView

__all__ = ["DistributedOptimizer", "OptimizerView", "Preemption", "ShardSampler", "Trainer"]

