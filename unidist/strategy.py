"""The typed seam between a Manager and the training layer behind it.

A Manager is handed its training strategy by its backend's record (``unidist.registry``) and never imports the
training layer: ``Manager.prepare``, ``backward``, the checkpoints and friends are calls into the object the
strategy makes over the started Manager. This module says, as Protocols, what that object answers
(:class:`TrainingStrategy`) and how it is made (:class:`Strategy`), so mypy follows ``prepare`` from the Manager
to the engine's trainer. It sits in the base layer and imports nothing at run time (``import unidist`` stays
light). What a trainer may ask of its Manager is ``unidist.train.world.TrainingWorld``, on the training side.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sized
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from unidist.ops import ReduceOp
    from unidist.prepared import PreparedOptimizer
    from unidist.request import PrepareRequest

__all__ = ["Loader", "Preemption", "SaveHandle", "Shard", "Strategy", "TrainingStrategy"]


class Loader(Protocol):
    """What ``mgr.loader`` returns (``unidist.train.data.Loader``): this rank's batches, on its device."""

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (a resumed run)."""


class Shard(Protocol):
    """What ``mgr.shard`` returns (``unidist.train.sampler.ShardSampler``): this rank's indices, a sampler."""

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None:
        """The permutation of epoch ``epoch`` (the same on every rank)."""


class Preemption(Protocol):
    """What ``mgr.preemption`` returns (``unidist.train.preempt.Preemption``)."""

    def requested(self) -> bool:
        """True on every rank at the same call once any rank got one of the signals (a collective)."""

    @property
    def signal(self) -> str | None:
        """The signal's name, once ``requested()`` said so."""

    @property
    def received_at(self) -> float | None: ...

    @property
    def closed(self) -> bool: ...

    def requeue(self) -> bool:
        """Put the Slurm job back in the queue (a collective); whether it was."""

    def close(self) -> None:
        """Restore the previous signal handlers."""


class SaveHandle(Protocol):
    """What ``mgr.save_checkpoint(..., blocking=False)`` returns (``unidist.checkpoint.background.SaveHandle``)."""

    def done(self) -> bool:
        """This rank's files are written (its background thread ended)."""

    @property
    def finished(self) -> bool: ...

    @property
    def published(self) -> bool: ...

    def wait(self) -> Path:
        """Publish the checkpoint (a collective: every rank calls it); its path."""

    def abandon(self) -> None: ...


class TrainingStrategy(Protocol):
    """What a Manager's training entry points call: one object per started Manager (see ``Manager.prepare``
    and its neighbours for each call's meaning and arguments). It may also have ``close(failing: bool)``,
    called as the Manager shuts down (unidist's Trainer finishes a background save there)."""

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, request: PrepareRequest
                ) -> tuple[torch.nn.Module, PreparedOptimizer]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def accumulate(self, model: torch.nn.Module) -> AbstractContextManager[None]: ...

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                              op: ReduceOp | str = ..., compression: str | None = None,
                              backward_passes_per_step: int = 1, bucket_mb: float | None = None,
                              clip_grad_norm: float | None = None) -> torch.optim.Optimizer: ...

    def broadcast_parameters(self, model_or_state: Any, root: int = 0) -> None: ...

    def broadcast_optimizer_state(self, optimizer: Any, root: int = 0) -> None: ...

    def gathered_parameters(self, module: torch.nn.Module) -> AbstractContextManager[None]: ...

    def partitioned_build(self, group: Any = None, enabled: bool = True) -> AbstractContextManager[Any]: ...

    def memory_stats(self) -> dict[str, int]: ...

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]: ...

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]: ...

    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, extra: dict[str, Any] | None = None, blocking: bool = True,
                        loader: Any = None, format: str = "unidist") -> Path | SaveHandle: ...

    def load_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module,
                        optimizer: Any = None, *, loader: Any = None) -> dict[str, Any]: ...

    def preemption(self, signals: Iterable[str | int], *, every: int, grace: float | None) -> Preemption: ...

    def shard(self, data: Sized | int, *, shuffle: bool, seed: int, drop_last: bool) -> Shard: ...

    def loader(self, dataset: Sized, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
               **kwargs: Any) -> Loader: ...


class Strategy(Protocol):
    """A backend's training strategy: called with the started Manager (``Strategy(mgr)``), it makes that
    Manager's :class:`TrainingStrategy`; ``latest_checkpoint`` needs no Manager. The Manager is typed ``Any``
    here because the base layer cannot name it; the trainer types it as ``unidist.train.world.TrainingWorld``."""

    def __call__(self, manager: Any) -> TrainingStrategy: ...

    def latest_checkpoint(self, directory: str | os.PathLike[str]) -> Path | None: ...
