"""What ``Manager.prepare`` hands back as the optimizer, on every backend: :class:`PreparedOptimizer`.

A real ``torch.optim.Optimizer`` (``isinstance`` holds, so LR schedulers take it, and ``param_groups`` and
``state_dict`` are the user's optimizer's), plus what a user of unidist reads from it whatever the engine behind it:
the reduction (``synchronize``, ``accumulate``), the clipping, the fp16 loss scale and its skipped steps, the ZeRO
stage and the accumulation window. Each engine's prepared optimizer implements it (unidist's in unidist/train,
DeepSpeed's and Horovod's in their packages, through ``unidist.train.prepared.Prepared``, which adds what the
trainer, the checkpoints and the fingerprint read); mypy checks that none of them leaves a member abstract.

In the base layer so that the Manager can name it without importing the training layer; imported on first use of a
Manager (it imports torch), never by ``import unidist``.
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager

import torch

__all__ = ["PreparedOptimizer"]


class PreparedOptimizer(torch.optim.Optimizer, abc.ABC):
    """The optimizer ``prepare`` returns: the contract every engine's honours."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Reduce the gradients now (``step`` then does not again): read or change the averaged gradients before
        the step."""

    @abc.abstractmethod
    def accumulate(self) -> AbstractContextManager[None]:
        """One optimizer step's micro-batches: the backward passes inside add their gradients locally and
        communicate nothing; leaving the block reduces everything once (``Manager.accumulate``)."""

    @property
    @abc.abstractmethod
    def zero_stage(self) -> int:
        """The ZeRO stage it trains at (0: every rank holds everything)."""

    @property
    @abc.abstractmethod
    def backward_passes_per_step(self) -> int:
        """The accumulation window: ``step`` acts on every k-th call."""

    @property
    @abc.abstractmethod
    def clipping(self) -> float | None:
        """The global gradient-norm clipping in effect (an engine's own included), or None."""

    @property
    @abc.abstractmethod
    def last_grad_norm(self) -> float | None:
        """The global L2 norm of the averaged gradients the last step measured, before clipping (None where nothing
        measured it: no clipping, and an engine that measures none)."""

    @property
    @abc.abstractmethod
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without loss scaling)."""

    @property
    @abc.abstractmethod
    def last_step_skipped(self) -> bool:
        """The last step found inf/nan gradients and was not applied (decided alike on every rank)."""

    @property
    @abc.abstractmethod
    def skipped_steps(self) -> int:
        """Steps skipped for inf/nan gradients so far (the same count on every rank)."""
