"""The Manager's training entry points: ``prepare``, ``backward``, checkpoints and friends, each a typed call into
the training strategy the Manager was handed when made (``unidist.strategy``), never an import of the training
layer. Kept apart from base.py (lifecycle, topology, groups) as the part of the public API that belongs to
training; ``Manager`` is ``TrainingEntryPoints`` plus the world's communicator."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence, Sized
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, overload

import torch

from unidist.comm.group import Group
from unidist.config import Config
from unidist.ops import ReduceOp
from unidist.prepared import PreparedOptimizer
from unidist.request import PrepareRequest
from unidist.strategy import Preemption, SaveHandle, Shard, Strategy, TrainingStrategy

__all__ = ["TrainingEntryPoints"]


class TrainingEntryPoints:
    """The training half of the Manager's public API. Each call goes to ``_training()``: the Manager's
    :class:`~unidist.strategy.TrainingStrategy`, made by its strategy over the started Manager on first use."""

    config: Config

    def _strategy(self) -> Strategy:
        raise NotImplementedError  # the Manager's (base.py): the strategy, imported on first use

    def _training(self) -> TrainingStrategy:
        raise NotImplementedError  # the Manager's (base.py): it makes the strategy once the engine has started

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                zero_stage: int | None = None, clip_grad_norm: float | None = None, op: ReduceOp | str = "mean",
                compression: str | None = None, backward_passes_per_step: int | None = None,
                bucket_mb: float | None = None, group: Group | None = None,
                deepspeed_config: Mapping[str, Any] | str | None = None, precision: str | None = None,
                loss_scaling: Mapping[str, Any] | None = None, reducer: str = "auto", sync_batchnorm: bool = False,
                offload: str | None = None, fingerprint: str | os.PathLike[str] | None = None,
                clip_norm_group: Group | None = None, clip_norm_replicas: Sequence[torch.nn.Parameter] | None = None,
                **unknown: Any) -> tuple[torch.nn.Module, PreparedOptimizer]:
        """Make ``model`` and ``optimizer`` data parallel; then ``mgr.backward(loss); opt.step();
        opt.zero_grad()`` is the whole loop, the same on every backend.

        The model moves to ``device`` with rank 0's parameters, the optimizer gets rank 0's state, and
        gradients are averaged, so N ranks on B/N rows each train exactly like one process on B rows. The
        returned optimizer is a ``torch.optim.Optimizer`` (LR schedulers, ``param_groups``, ``state_dict``) and a
        :class:`~unidist.prepared.PreparedOptimizer` (``synchronize``, ``clipping``, ``loss_scale``,
        ``last_step_skipped``...). Every argument is checked before anything changes: the keywords are the fields
        of :class:`~unidist.request.PrepareRequest`, where each is documented once; None takes the ``UNIDIST_*``
        default, and an unknown keyword is refused with the nearest accepted one.

        Args:
            model: the user's module. ``mgr.unwrap(returned_model)`` gives it back on every backend.
            optimizer: any ``torch.optim.Optimizer`` over the model's parameters (None on the deepspeed backend
                when its config has an ``optimizer`` section).
            unknown: any other keyword: refused (``InvalidArgumentError``) with the nearest accepted one
                (``clip_grad`` -> ``clip_grad_norm``).

        The other keywords (``zero_stage``, ``clip_grad_norm``, ``op``, ``compression``, ``backward_passes_per_step``,
        ``bucket_mb``, ``group``, ``deepspeed_config``, ``precision``, ``loss_scaling``, ``reducer``,
        ``sync_batchnorm``, ``offload``, ``fingerprint``, ``clip_norm_group``, ``clip_norm_replicas``) are
        :class:`~unidist.request.PrepareRequest`'s fields,
        documented there.
        """
        return self._training().prepare(model, optimizer, PrepareRequest.build(self.config, dict(
            zero_stage=zero_stage, clip_grad_norm=clip_grad_norm, op=op, compression=compression,
            backward_passes_per_step=backward_passes_per_step, bucket_mb=bucket_mb, group=group,
            deepspeed_config=deepspeed_config, precision=precision, loss_scaling=loss_scaling, reducer=reducer,
            sync_batchnorm=sync_batchnorm, offload=offload, fingerprint=fingerprint, clip_norm_group=clip_norm_group,
            clip_norm_replicas=clip_norm_replicas, **unknown)))

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for the prepared model (divided by ``backward_passes_per_step``; on DeepSpeed
        ``engine.backward``)."""
        self._training().backward(loss)

    def accumulate(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        """A block for one optimizer step's micro-batches: the backward passes inside add their gradients
        locally and communicate nothing (on ZeRO-3 the parameters stay gathered for the block, so the forwards do
        not fetch them either); leaving the block reduces everything once; then ``opt.step(); opt.zero_grad()``.
        Gradients add up as with plain ``loss.backward()``: divide each micro-batch's loss by their number for a
        mean. The form of DDP's ``no_sync`` and Accelerate's ``accumulate``, on every backend
        (``backward_passes_per_step`` is the other form; use one of them).

        Args:
            model: what ``prepare`` returned.
        """
        return self._training().accumulate(model)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module behind what ``prepare`` returned (a DeepSpeed engine's ``module``)."""
        return self._training().unwrap(model)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                              op: ReduceOp | str = ReduceOp.MEAN, compression: str | None = None,
                              backward_passes_per_step: int = 1, bucket_mb: float | None = None,
                              clip_grad_norm: float | None = None) -> torch.optim.Optimizer:
        """Gradient averaging around ``optimizer`` (unidist's DistributedOptimizer; Horovod's on horovod).

        Args: as ``prepare``; ``named_parameters`` (optional) checks that every optimized parameter is known.
        """
        return self._training().distributed_optimizer(
            optimizer, named_parameters, op=op, compression=compression,
            backward_passes_per_step=backward_passes_per_step, bucket_mb=bucket_mb, clip_grad_norm=clip_grad_norm)

    def broadcast_parameters(self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]
                             | Iterable[tuple[str, torch.Tensor]], root: int = 0) -> None:
        """Root's parameters and buffers, in place, everywhere (a module, a state dict or named tensors)."""
        self._training().broadcast_parameters(model_or_state, root)

    def broadcast_optimizer_state(self, optimizer: Any, root: int = 0) -> None:
        """Root's optimizer state (tensors and Python scalars such as Adam's step) loaded everywhere."""
        self._training().broadcast_optimizer_state(optimizer, root)

    def gathered_parameters(self, module: torch.nn.Module) -> AbstractContextManager[None]:
        """Context manager with the module's full parameters inside (ZeRO stage 3 partitions them)."""
        return self._training().gathered_parameters(module)

    def partitioned_build(self, group: Any = None, enabled: bool = True) -> AbstractContextManager[Any]:
        """Context manager: modules built inside it are partitioned as they are built (as ``deepspeed.zero.Init``),
        so a model bigger than one rank's memory can be built; ``prepare(..., zero_stage=3)`` shards it from there
        (any other prepare makes it whole first). Every rank must build the same modules in the same order.

        Args:
            group: the Group prepare will be given (``group=``); None: the world.
            enabled: False builds whole (a config switch, as ``zero.Init(enabled=...)``).
        """
        return self._training().partitioned_build(group, enabled)

    def memory_stats(self) -> dict[str, int]:
        """This rank's bytes for the prepared model: ``param_bytes``, ``grad_bytes`` (gradients and the
        buffers that keep them between steps), ``optimizer_bytes`` (optimizer state, with DeepSpeed's fp32
        master partitions) and ``peak_bytes`` (the process: CUDA peak allocation, or peak RSS on CPU)."""
        return self._training().memory_stats()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The prepared model's state dict as one process would hold it, on every rank (ZeRO gathered).

        Args:
            model: what ``prepare`` returned (or the user's module behind it).
        """
        return self._training().full_state_dict(model)

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """The prepared optimizer's state dict as one process would hold it (every parameter's state, indexed
        as in the user's optimizer), on every rank; a collective under ZeRO.

        Args:
            optimizer: what ``prepare`` returned.
        """
        return self._training().full_optimizer_state_dict(optimizer)

    # ----------------------------------------------------------------- checkpoints (unidist.checkpoint)
    @overload
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: Literal[True] = True, loader: Any = None,
                        format: str = "unidist", **extra: Any) -> Path: ...

    @overload
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: Literal[False], loader: Any = None,
                        format: str = "unidist", **extra: Any) -> SaveHandle: ...

    @overload
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: bool, loader: Any = None,
                        format: str = "unidist", **extra: Any) -> Path | SaveHandle: ...

    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: bool = True, loader: Any = None,
                        format: str = "unidist", **extra: Any) -> Path | SaveHandle:
        """Save model (and optimizer) state to the directory ``path``, atomically; every rank calls it.

        The format depends on neither the backend, nor the world size, nor the ZeRO stage: each rank writes
        the slices it owns, rank 0 the manifest, and the directory appears complete or not at all.

        ``blocking=False`` returns once this rank's state is copied to host memory (a snapshot: training may
        change the parameters at once), and a background thread writes this rank's files; ``handle.wait()``
        publishes the checkpoint and returns its path. The thread runs no collective (one beside the training
        thread's collectives on the same communicator would deadlock or mismatch), so the cross-rank end (all
        shards written, the manifest, the atomic rename) runs in ``wait()``, which **every rank must call**, or
        which the next ``save_checkpoint``/``load_checkpoint`` and the ``with`` block's exit run for you. A
        second save while one is in flight first waits for it (one in flight, as torch.distributed.checkpoint's
        ``async_save``). Until it is published, ``latest_checkpoint`` returns the previous checkpoint, and a
        crash leaves that one loadable.

        Args:
            path: the checkpoint directory (an existing checkpoint there is replaced only once the new one
                is complete).
            model: what ``prepare`` returned. optimizer: what ``prepare`` returned, or None for weights only.
            keep: keep only the newest ``keep`` checkpoints in ``path``'s parent directory (None: keep all).
            blocking: True (default): return the path once published. False: return a ``SaveHandle``
                (unidist.checkpoint.background; typed ``Any`` here, as managers/ imports no layer above it;
                ``wait()`` -> path, raising the writer's error as a CheckpointError on every rank; ``done()``:
                this rank's files are written).
            loader: a loader from ``mgr.loader``: its position (epoch, and how far into it) is saved, so
                ``load_checkpoint(..., loader=)`` resumes mid-epoch at the next batch.
            format: "unidist" (the default: digests, background saves, retention, hosts without a shared
                filesystem) or "dcp": a torch distributed checkpoint directory, in ``get_state_dict``'s names,
                that FSDP2's and DDP's own scripts load with ``dcp.load`` (each rank writes its own slices; a
                half-precision weight's float32 master copy is written as the weight; ``extra`` entries are top-level
                entries), or "deepspeed": the files real DeepSpeed's ``engine.load_checkpoint`` resumes from at this
                world size and ZeRO stage (``extra["deepspeed"]``: its counters, scheduler state and config; the
                other entries are its ``client_state``). ``load_checkpoint`` reads all three.
            extra: anything else to restore (step counters, ``scheduler.state_dict()``): tensors, numbers,
                strings, lists and dicts, as ``torch.load(weights_only=True)`` accepts.

        Every rank's random generators (torch, CUDA, numpy, ``random``) are saved too and restored by
        ``load_checkpoint``.
        """
        return self._training().save_checkpoint(
            path, model, optimizer, keep=keep, extra=extra, blocking=blocking, loader=loader, format=format)

    def load_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        loader: Any = None) -> dict[str, Any]:
        """Load a checkpoint saved by any backend, world size and ZeRO stage into the prepared model (and
        optimizer), and return its ``extra``. Every rank checks the whole checkpoint first: a mismatch is a
        CheckpointMismatchError naming the first differing parameter, a damaged file a CheckpointCorruptError
        naming it, and then nothing was modified on any rank.

        Args:
            path: a checkpoint directory (``latest_checkpoint(dir)`` finds the newest).
            model: what ``prepare`` returned.
            optimizer: what ``prepare`` returned, or None for the weights only.
            loader: a loader from ``mgr.loader``, put where the saved one was (``save_checkpoint(..., loader=)``):
                its next iteration goes on at the next batch, at this run's number of ranks.
        """
        return self._training().load_checkpoint(path, model, optimizer, loader=loader)

    def latest_checkpoint(self, directory: str | os.PathLike[str]) -> Path | None:
        """The newest complete checkpoint directly inside ``directory``, or None (no collective).

        Args:
            directory: where ``save_checkpoint`` wrote checkpoint directories.
        """
        latest: Path | None = self._strategy().latest_checkpoint(directory)
        return latest

    def preemption(self, signals: Iterable[str | int] = ("SIGUSR1", "SIGTERM"), every: int = 1,
                   grace: float | None = None) -> Preemption:
        """Catch the signals a scheduler sends before it ends the job (Slurm: SIGUSR1 ahead of the time limit with
        ``sbatch --signal=USR1@SECONDS``, SIGTERM on preemption and ``scancel``), so the loop saves a checkpoint on
        every rank and leaves cleanly: ``if stop.requested(): save; break``. The handlers only note the signal;
        ``stop.requested()`` is a collective that is True on every rank at the same call once any rank got one.
        Main thread only; undone at shutdown. A signal ``requested()`` has not reported within ``grace`` seconds
        is raised again with its previous handler (SIGTERM's default ends the process). See unidist.train.preempt.

        Args:
            signals: names (``"SIGUSR1"``), numbers or ``signal.Signals`` members.
            every: ``requested()`` communicates (one int, a MAX allreduce) on every ``every``-th call only.
            grace: seconds, or ``math.inf`` for never; default ``UNIDIST_TIMEOUT``.

        Returns:
            a ``Preemption`` (``unidist.strategy.Preemption``): ``requested()``, ``signal``, ``received_at``,
            ``requeue()``, ``close()``.
        """
        stop = self._training().preemption(signals, every=every, grace=grace)
        self._preemption = stop
        return stop

    def shard(self, data: Sized | int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> Shard:
        """A sampler giving this rank its disjoint share, reshuffled by ``set_epoch`` (same on every rank)."""
        return self._training().shard(data, shuffle=shuffle, seed=seed, drop_last=drop_last)
