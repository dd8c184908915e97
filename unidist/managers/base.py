"""Manager: one distributed run of one engine — lifecycle, topology, groups, and the training entry points.

The Manager is the world's Communicator (``unidist.comm``: every collective, written once) over the Engine its
backend makes when it starts; managers/<engine>.py has each backend's engine and start-up/shutdown. Training
lives in ``unidist.train``, built on the collectives: the entry points here (``prepare``, ``backward``, ...)
only hand over to it, importing it on first use, so the collective layers below never depend on it at import
time.
"""

from __future__ import annotations

import abc
import logging
import os
import sys
import traceback
import weakref
from collections.abc import Iterable, Mapping, Sequence, Sized
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Literal, overload

import torch

from unidist.comm import processes, timeline, watchdog
from unidist.comm.communicator import Communicator
from unidist.comm.engine import Engine
from unidist.comm.group import Group
from unidist.comm.work import DONE, EngineWork, Handle, Work
from unidist.config import Config
from unidist.errors import CollectiveMismatchError, ConfigError, InvalidArgumentError, NotInitializedError, UnidistError
from unidist.launch import LaunchInfo, detect
from unidist.net import host_address, local_only_env
from unidist.ops import ReduceOp
from unidist.registry import Strategy, get
from unidist.tree import to_device

__all__ = ["DONE", "EngineWork", "Group", "Handle", "Manager", "Work", "get_manager"]

_log = logging.getLogger("unidist")
_active: Manager | None = None


def get_manager() -> Manager:
    """The started Manager of this process."""
    if _active is None:
        raise NotInitializedError("no unidist Manager is active; start one with `with unidist.init() as mgr:`")
    return _active


class Manager(Communicator):
    """One distributed run. ``with Manager() as mgr:`` starts the engine and always shuts it down; in between
    the Manager is the world's communicator over that engine."""

    name: ClassVar[str] = "base"

    def __init__(self, config: Config | None = None, launch: LaunchInfo | None = None, *,
                 strategy: Strategy | None = None) -> None:
        """Args:
            config: the settings (default: ``Config.from_env()``). launch: what the launcher said (default:
                ``detect()``).
            strategy: the training layer behind ``prepare``, ``backward`` and the checkpoints (default: the
                one this backend's record in ``unidist.registry`` names).
        """
        self.config = config if config is not None else Config.from_env()
        self.launch = launch if launch is not None else detect()
        self._strategy = strategy if strategy is not None else get(self.name).strategy()
        self._started = False
        self._rank = self._size = self._local_rank = self._local_size = self._node_rank = -1
        self._device = torch.device("cpu")
        self._saved_env: dict[str, str | None] = {}
        self._failing = False  # set by __exit__ when an exception is leaving the with block
        self._trainer: Any = None
        self._preemption: Any = None  # mgr.preemption()'s object: its signal handlers are undone at shutdown
        self._made_groups: weakref.WeakSet[Group] = weakref.WeakSet()  # disabled at shutdown
        self._init_collectives()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Manager:
        """Start the engine; ``with`` does this for you. A Manager starts once."""
        global _active
        if self._started:
            raise UnidistError(f"{type(self).__name__} is already started; start it once (one `with` block)")
        if _active is not None:
            raise UnidistError(
                f"another Manager ({type(_active).__name__}) is active in this process; shut it down first"
            )
        logging.getLogger("unidist").setLevel(self.config.log_level)
        try:
            if 1 < self.launch.size == self.launch.local_size:  # one node: the engines listen on loopback only
                for name, value in local_only_env().items():
                    self._setenv(name, value, only_if_unset=True)
            engine = self._start()
            self._device = self._pick_device()
        except BaseException:
            self._restore_env()
            raise
        # every call recorded when UNIDIST_TIMELINE is set (comm/timeline.py: the engine itself when not), and
        # every wait on peers bounded by UNIDIST_TIMEOUT (comm/watchdog.py): the engine is wrapped once, here
        engine = timeline.recording(engine, self.config.timeline, self.config.timeline_events)
        self._bind(watchdog.watch(engine) if engine.size > 1 else engine)
        self._started = True
        _active = self
        self._enable_fast_path()
        if self._size > 1:
            token = torch.frombuffer(bytearray(os.urandom(12)), dtype=torch.uint8)  # not the user's RNG
            self._broadcast(token, 0)  # the job's name for its heartbeat directory
            # the ranks of other hosts are asked over the network: every rank exchanges (the local sizes the
            # launcher gives need not agree); those sharing their host with fewer than all listen, on its cluster
            # address (none when the host has no route: loopback cannot be reached from another host)
            address = host_address() if self._local_size < self._size else "127.0.0.1"
            timeline.align(self)  # before the watchdog starts counting calls: the count is the same either way
            watchdog.start(self.config.timeout, self._rank, self._size, bytes(token.tolist()).hex(),
                           self._engine.abort, address=None if address.startswith("127.") else address,
                           exchange=self.allgather_object, stall_warning=self.config.stall_warning)
        _log.info("%s started: rank %d of %d on %s", type(self).__name__, self._rank, self._size, self._device)
        return self

    def shutdown(self) -> None:
        """Shut the engine down and undo what ``start`` changed; safe to call twice."""
        global _active
        if not self._started:
            return
        refused = None
        try:
            close = getattr(self._trainer, "close", None)
            if callable(close):  # the training layer's own leaving (a background save nobody waited for)
                close(failing=self._failing)
            if not self._failing and self._size > 1:
                # ranks leave together; one leaving while a peer still waits in a collective is caught here,
                # by the watchdog (a rank that leaves on failure skips it: its peers may be gone)
                with watchdog.watching(watchdog.LEAVING):
                    self._barrier()
                refused = self._pending_mismatch()  # a message its receiver refused: said once all have left
                timeline.finish(self)
            self._shutdown()
        finally:
            if self._preemption is not None:  # the handlers it installed go with the Manager
                self._preemption.close()
                self._preemption = None
            timeline.abandon()  # still recording: this rank failed, or ran alone; its part is kept
            watchdog.stop()
            self._started = False
            self._disable_fast_path()
            for group in list(self._made_groups):  # their fast path skips the started check too
                group._disable_fast_path()
            self._made_groups.clear()
            if _active is self:
                _active = None
            self._restore_env()
        if refused is not None:
            raise refused

    def __enter__(self) -> Manager:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        try:
            failed = exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))
            self._failing = failed
            if failed and self._started and self._size > 1:
                self._abort_job(exc)  # type: ignore[arg-type]
        finally:
            self.shutdown()
        return False

    def _abort_job(self, exc: BaseException) -> None:
        """One rank failed while the others may wait in a collective; engines that can, end the job (the
        others' launchers stop the job when this process exits)."""
        if self._engine.aborts_job:
            self._report_failure(exc)
            processes.end_job(self._engine.abort, 1)

    def _report_failure(self, exc: BaseException) -> None:
        print(f"unidist: rank {self._rank} of {self._size} failed; ending the job so the other ranks do not "
              "wait forever:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        sys.stderr.flush()

    def _setenv(self, name: str, value: str, *, only_if_unset: bool = False) -> None:
        """Set an environment variable for the engine (or leave the user's, ``only_if_unset``); restored at
        shutdown."""
        if only_if_unset and os.environ.get(name):
            return
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def _restore_env(self) -> None:
        for name, old in self._saved_env.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        self._saved_env.clear()

    def _pick_device(self) -> torch.device:
        want = self.config.device
        if want == "cpu":
            return torch.device("cpu")
        if want.startswith("cuda:"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if int(want.split(":")[1]) >= count:
                raise ConfigError(f"UNIDIST_DEVICE={want!r} but torch sees {count} CUDA device(s)"
                                  + ("; unset it or use 'cpu'" if count == 0 else f"; use cuda:0..cuda:{count - 1}"))
            return torch.device(want)
        if torch.cuda.is_available():
            return torch.device(f"cuda:{self._local_rank % torch.cuda.device_count()}")
        if want == "cuda":
            raise ConfigError("UNIDIST_DEVICE='cuda' but torch sees no CUDA device; unset it or use 'cpu'")
        return torch.device("cpu")

    # ----------------------------------------------------------------- topology
    def _need_started(self) -> None:
        if not self._started:
            raise NotInitializedError(
                f"{type(self).__name__} is not started; use `with unidist.init() as mgr:` or call mgr.start()"
            )

    @property
    def started(self) -> bool:
        return self._started

    @property
    def local_rank(self) -> int:
        self._need_started()
        return self._local_rank

    @property
    def local_size(self) -> int:
        self._need_started()
        return self._local_size

    @property
    def node_rank(self) -> int:
        self._need_started()
        return self._node_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return self.name

    @property
    def device(self) -> torch.device:
        self._need_started()
        return self._device

    def to_device(self, batch: Any, non_blocking: bool | None = None) -> Any:
        """``batch`` with every tensor on ``device``: tensors in dicts, lists, tuples, namedtuples, dataclasses and
        ``ModelOutput``-like mappings, each container keeping its type (other objects come back unchanged).

        Args:
            batch: a tensor or a nested batch.
            non_blocking: asynchronous copies; by default only from pinned memory to a GPU, where it is safe.
        """
        return to_device(batch, self.device, non_blocking)

    def loader(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
               drop_last: bool = False, **kwargs: Any) -> Any:
        """This rank's ``DataLoader`` over ``dataset``: its disjoint share (reshuffled each epoch, the same on every
        rank, with ``shuffle``), pinned memory on a GPU, each batch already on ``device``. Iterating again starts
        the next epoch; ``.set_epoch(e)`` picks one (a resume). See ``unidist.train.data.Loader``.

        Args:
            dataset: a map-style dataset (``len()`` and ``[i]``).
            batch_size: rows per batch on this rank.
            shuffle: a new permutation every epoch.
            seed: the permutation's seed.
            drop_last: drop the tail that does not divide among the ranks and an incomplete last batch (False:
                wrap around, so every rank gets as many rows).
            kwargs: other ``torch.utils.data.DataLoader`` arguments (``num_workers``, ``collate_fn``...).
        """
        return self._training().loader(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                       drop_last=drop_last, **kwargs)

    def __repr__(self) -> str:
        if not self._started:
            return f"<{type(self).__name__} not started>"
        return f"<{type(self).__name__} rank {self._rank}/{self._size} local {self._local_rank}/" \
               f"{self._local_size} node {self._node_rank} device {self._device}>"

    # ----------------------------------------------------------------- lifecycle primitives
    @abc.abstractmethod
    def _start(self) -> Engine:
        """Initialise the library, set _local_rank, _local_size, _node_rank and return the world's engine."""

    @abc.abstractmethod
    def _shutdown(self) -> None: ...

    # ----------------------------------------------------------------- groups
    def new_group(self, ranks: Sequence[int]) -> Group | None:
        """A Group of ``ranks`` (world ranks, in group order); every rank calls it with the same list.

        Members get the Group, the others None. A rank that passes another list is a CollectiveMismatchError
        on every rank, instead of a hang inside the engine.
        """
        self._need_started()
        members = _rank_list(ranks, self._size)
        seen = self.allgather_object(members)
        if any(other != members for other in seen):
            raise CollectiveMismatchError("new_group: ranks passed different lists: " +
                                          "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen)))
        return self._groups([members])[0]

    def split(self, color: int | None, key: int | None = None) -> Group | None:
        """MPI_Comm_split: ranks passing the same ``color`` form one Group, ordered by ``key`` (default: world
        rank; ties by world rank). Every rank calls it; ``color=None`` joins no group and gets None."""
        self._need_started()
        if color is not None and (isinstance(color, bool) or not hasattr(color, "__index__")):
            raise InvalidArgumentError(f"split(color={color!r}) takes an int, or None for no group")
        if key is not None and (isinstance(key, bool) or not hasattr(key, "__index__")):
            raise InvalidArgumentError(f"split(key={key!r}) takes an int")
        mine = (None if color is None else int(color), self._rank if key is None else int(key))
        table = self.allgather_object(mine)
        colors = sorted({c for c, _ in table if c is not None})
        lists = [[r for _, r in sorted((k, r) for r, (c, k) in enumerate(table) if c == col)] for col in colors]
        made = self._groups(lists)
        return None if mine[0] is None else made[colors.index(mine[0])]

    def _groups(self, lists: Sequence[Sequence[int]]) -> list[Group | None]:
        """One Group per list (this rank's or None), created on every rank in the same order, each over its
        sub-engine (``Engine.sub``)."""
        engines = self._engine.sub(lists)
        out = [None if e is None else Group(self, members, e) for members, e in zip(lists, engines, strict=True)]
        self._made_groups.update(g for g in out if g is not None)
        return out

    # ----------------------------------------------------------------- training entry points
    # Thin calls into the training layer: the strategy this Manager was handed when made, never imported here.
    def _training(self) -> Any:
        """This backend's trainer (its strategy made over this Manager), made on first use."""
        if self._trainer is None:
            self._need_started()
            self._trainer = self._strategy(self)
        return self._trainer

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                zero_stage: int | None = None, clip_grad_norm: float | None = None, op: ReduceOp | str = "mean",
                compression: str | None = None, backward_passes_per_step: int | None = None,
                bucket_mb: float | None = None, group: Group | None = None,
                deepspeed_config: Mapping[str, Any] | str | None = None, precision: str | None = None,
                loss_scaling: Mapping[str, Any] | None = None, reducer: str = "auto", sync_batchnorm: bool = False,
                offload: str | None = None, **unknown: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Make ``model`` and ``optimizer`` data parallel; then ``mgr.backward(loss); opt.step();
        opt.zero_grad()`` is the whole loop, the same on every backend.

        The model moves to ``device`` with rank 0's parameters, the optimizer gets rank 0's state, and
        gradients are averaged, so N ranks on B/N rows each train exactly like one process on B rows. The
        returned optimizer is a ``torch.optim.Optimizer`` (LR schedulers, ``param_groups``, ``state_dict``).
        Every argument is checked before anything changes.

        Args:
            model: the user's module. ``mgr.unwrap(returned_model)`` gives it back on every backend.
            optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
            zero_stage: 0-3 (default ``UNIDIST_ZERO_STAGE``): 1 shards optimizer state, 2 also gradients,
                3 also parameters; DeepSpeed's own ZeRO on the deepspeed backend, unidist's elsewhere.
            clip_grad_norm: clip the averaged gradient to this global L2 norm, as
                ``torch.nn.utils.clip_grad_norm_`` on one process would; None (default) never clips, on every
                backend (DeepSpeed's own default of 1.0 is switched off).
            op: ``"mean"`` (default) or ``"sum"`` of the ranks' gradients (DeepSpeed only averages).
            compression: ``"none"``, ``"fp16"`` or ``"bf16"`` wire dtype for gradients (default
                ``UNIDIST_COMPRESSION``).
            backward_passes_per_step: k (default 1, or the DeepSpeed config's gradient_accumulation_steps):
                ``step()``/``zero_grad()`` act on every k-th call and ``backward`` divides the loss by k, so k
                passes make one k-times larger batch.
            bucket_mb: gradient fusion bucket size in MiB (default ``UNIDIST_BUCKET_MB``).
            group: data parallel over this Group only (parameters from its rank 0, gradients averaged within
                it); None is the whole world.
            deepspeed_config: a DeepSpeed config (dict or JSON path) merged over the generated one; the
                deepspeed backend only (default ``UNIDIST_DEEPSPEED_CONFIG``). A setting it shares with an
                argument above (ZeRO stage, clipping, precision, accumulation) must agree with it.
            precision: ``"32"`` (default ``UNIDIST_PRECISION``), ``"bf16-mixed"`` or ``"fp16-mixed"`` (autocast
                forward, float32 parameters and optimizer state; fp16 adds dynamic loss scaling: a step with
                inf/nan gradients is skipped on every rank, see ``opt.last_step_skipped`` and ``opt.loss_scale``)
                or ``"bf16-true"`` (a bfloat16 model). Outputs come back as float32.
            loss_scaling: fp16's dynamic loss scaling, with ``torch.amp.GradScaler``'s parameters and defaults:
                ``{"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}``,
                and DeepSpeed's (``dynamic``, ``hysteresis``, ``consecutive_hysteresis``, ``min_scale``,
                ``growth_rule``, ``raise_at_min_scale``: ``unidist.train.precision.ScalerOptions``).
            reducer: who averages the gradients where the engine has a reducer of its own: ``"engine"``
                (DeepSpeed's engine, ``hvd.DistributedOptimizer``), ``"unidist"`` (unidist's fusion buckets over
                the engine's collectives; the engine's optimizer step, clipping and loss scaling unchanged) or
                ``"auto"`` (default: unidist's where it was measured faster and keeps the engine's math, see
                ``unidist.train.reducer``). The mpi, torch and local backends always use unidist's.
            sync_batchnorm: replace every BatchNorm of the model with one that normalises by the statistics of the
                whole batch across the data-parallel ranks (``unidist.train.sync_batchnorm``; CPU and GPU, every
                backend), so N ranks train like one process on B rows with BatchNorm too. Default False: each rank's
                own rows, as DDP without ``convert_sync_batchnorm``. Either way every rank holds rank 0's buffers
                (running statistics) after every optimizer step.
            offload: ``"cpu"`` keeps the optimizer state (ZeRO's shards, their gradients, and at stage 3 the parameter
                shards between uses) in pinned host memory and steps it there (``unidist.train.offload``; DeepSpeed's
                ``offload_optimizer``/``offload_param`` on the deepspeed backend): device memory for host memory and
                copies, the same training. Needs ``zero_stage`` 1-3; a no-op, said once, where the device is the CPU.
                Default None.
        """
        return self._training().prepare(  # type: ignore[no-any-return]
            model, optimizer, zero_stage=zero_stage, clip_grad_norm=clip_grad_norm, op=op, compression=compression,
            backward_passes_per_step=backward_passes_per_step, bucket_mb=bucket_mb, group=group,
            deepspeed_config=deepspeed_config, precision=precision, loss_scaling=loss_scaling, reducer=reducer,
            sync_batchnorm=sync_batchnorm, offload=offload, unknown=unknown)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for the prepared model (divided by ``backward_passes_per_step``; on DeepSpeed
        ``engine.backward``)."""
        self._training().backward(loss)

    def accumulate(self, model: torch.nn.Module) -> Any:
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
        return self._training().unwrap(model)  # type: ignore[no-any-return]

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                              op: ReduceOp | str = ReduceOp.MEAN, compression: str | None = None,
                              backward_passes_per_step: int = 1, bucket_mb: float | None = None,
                              clip_grad_norm: float | None = None) -> torch.optim.Optimizer:
        """Gradient averaging around ``optimizer`` (unidist's DistributedOptimizer; Horovod's on horovod).

        Args: as ``prepare``; ``named_parameters`` (optional) checks that every optimized parameter is known.
        """
        return self._training().distributed_optimizer(  # type: ignore[no-any-return]
            optimizer, named_parameters, op=op, compression=compression,
            backward_passes_per_step=backward_passes_per_step, bucket_mb=bucket_mb, clip_grad_norm=clip_grad_norm)

    def broadcast_parameters(self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]
                             | Iterable[tuple[str, torch.Tensor]], root: int = 0) -> None:
        """Root's parameters and buffers, in place, everywhere (a module, a state dict or named tensors)."""
        self._training().broadcast_parameters(model_or_state, root)

    def broadcast_optimizer_state(self, optimizer: Any, root: int = 0) -> None:
        """Root's optimizer state (tensors and Python scalars such as Adam's step) loaded everywhere."""
        self._training().broadcast_optimizer_state(optimizer, root)

    def gathered_parameters(self, module: torch.nn.Module) -> Any:
        """Context manager with the module's full parameters inside (ZeRO stage 3 partitions them)."""
        return self._training().gathered_parameters(module)

    def memory_stats(self) -> dict[str, int]:
        """This rank's bytes for the prepared model: ``param_bytes``, ``grad_bytes`` (gradients and the
        buffers that keep them between steps), ``optimizer_bytes`` (optimizer state, with DeepSpeed's fp32
        master partitions) and ``peak_bytes`` (the process: CUDA peak allocation, or peak RSS on CPU)."""
        return self._training().memory_stats()  # type: ignore[no-any-return]

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The prepared model's state dict as one process would hold it, on every rank (ZeRO gathered).

        Args:
            model: what ``prepare`` returned (or the user's module behind it).
        """
        return self._training().full_state_dict(model)  # type: ignore[no-any-return]

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """The prepared optimizer's state dict as one process would hold it (every parameter's state, indexed
        as in the user's optimizer), on every rank; a collective under ZeRO.

        Args:
            optimizer: what ``prepare`` returned.
        """
        return self._training().full_optimizer_state_dict(optimizer)  # type: ignore[no-any-return]

    # ----------------------------------------------------------------- checkpoints (unidist.checkpoint)
    @overload
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: Literal[True] = True, **extra: Any) -> Path: ...

    @overload
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: Literal[False], **extra: Any) -> Any: ...

    @overload
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: bool, **extra: Any) -> Any: ...

    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, blocking: bool = True, **extra: Any) -> Any:
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
            extra: anything else to restore (step counters, ``scheduler.state_dict()``): tensors, numbers,
                strings, lists and dicts, as ``torch.load(weights_only=True)`` accepts.
        """
        return self._training().save_checkpoint(  # type: ignore[no-any-return]
            path, model, optimizer, keep=keep, extra=extra, blocking=blocking)

    def load_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None
                        ) -> dict[str, Any]:
        """Load a checkpoint saved by any backend, world size and ZeRO stage into the prepared model (and
        optimizer), and return its ``extra``. Every rank checks the whole checkpoint first: a mismatch is a
        CheckpointMismatchError naming the first differing parameter, a damaged file a CheckpointCorruptError
        naming it, and then nothing was modified on any rank.

        Args:
            path: a checkpoint directory (``latest_checkpoint(dir)`` finds the newest).
            model: what ``prepare`` returned.
            optimizer: what ``prepare`` returned, or None for the weights only.
        """
        return self._training().load_checkpoint(path, model, optimizer)  # type: ignore[no-any-return]

    def latest_checkpoint(self, directory: str | os.PathLike[str]) -> Path | None:
        """The newest complete checkpoint directly inside ``directory``, or None (no collective).

        Args:
            directory: where ``save_checkpoint`` wrote checkpoint directories.
        """
        latest: Path | None = self._strategy.latest_checkpoint(directory)
        return latest

    def preemption(self, signals: Iterable[str | int] = ("SIGUSR1", "SIGTERM"), every: int = 1,
                   grace: float | None = None) -> Any:
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
            a ``Preemption``: ``requested()``, ``signal``, ``received_at``, ``requeue()``, ``close()`` (typed
            ``Any`` here: managers/ imports no layer above it).
        """
        stop = self._training().preemption(signals, every=every, grace=grace)
        self._preemption = stop
        return stop

    def shard(self, data: Sized | int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> Any:
        """A sampler giving this rank its disjoint share, reshuffled by ``set_epoch`` (same on every rank)."""
        return self._training().shard(data, shuffle=shuffle, seed=seed, drop_last=drop_last)


def _rank_list(ranks: Sequence[int], size: int) -> list[int]:
    """World ranks in group order from a list, tuple, range, array or tensor (a set has no order: refused)."""
    if isinstance(ranks, (str, bytes, set, frozenset, Mapping)) or not hasattr(ranks, "__iter__"):
        raise InvalidArgumentError(f"new_group(ranks={ranks!r}) takes a list of world ranks, in group order")
    listed = list(ranks)
    if not listed:
        raise InvalidArgumentError("new_group(ranks=[]) names no rank; a group needs at least one")
    members = []
    for r in listed:
        if isinstance(r, bool) or not hasattr(r, "__index__") or not 0 <= int(r) < size:
            raise InvalidArgumentError(f"new_group: {r!r} is not a world rank (0..{size - 1})")
        members.append(int(r))
    if len(set(members)) != len(members):
        raise InvalidArgumentError(f"new_group(ranks={members}) names a rank twice")
    return members
