"""Trainer: the training entry points of a Manager, written once on its collectives.

``Manager.prepare``, ``backward``, ``unwrap`` and friends hand over to the Trainer of their backend:
this one (unidist's DistributedOptimizer; local, MPI, torch, and any backend when ``group=`` is given), or a
subclass that uses an engine's own training machinery (engines/deepspeed/trainer.py, engines/horovod/trainer.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import weakref
from collections.abc import Iterable, Mapping, Sized
from pathlib import Path
from typing import Any

import torch

import unidist.checkpoint as checkpoint
from unidist.checkpoint.background import SaveHandle, save_async
from unidist.checkpoint.dcp_writer import save_dcp
from unidist.checkpoint.deepspeed_writer import save_deepspeed
from unidist.checkpoint.layout import FullLayout, Layout, first_names
from unidist.comm import trace_hooks
from unidist.comm.group import Group
from unidist.comm.param_comm import reduce_comm_of, split_by_comm
from unidist.comm.protocol import Comm
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.request import PrepareRequest, SyncOptions
from unidist.train import offload, resume, zero_init
from unidist.train.broadcast_state import broadcast_optimizer_state, broadcast_parameters
from unidist.train.buffer_sync import BufferSync
from unidist.train.data import Loader
from unidist.train.ddp import DistributedOptimizer
from unidist.train.fingerprint import Fingerprint, path_for, verify_parts
from unidist.train.memory import MemoryStats, optimizer_tensors, peak_bytes, storage_bytes
from unidist.train.precision import LossScaler, Precision
from unidist.train.preempt import Preemption
from unidist.train.prepared import Prepared
from unidist.train.sampler import ShardSampler
from unidist.train.sync_batchnorm import convert_sync_batchnorm
from unidist.train.world import TrainingWorld
from unidist.train.zero import ZeroOptimizer

FORMATS = ("unidist", "dcp", "deepspeed")  # what save_checkpoint(format=) writes; load_checkpoint reads them all

__all__ = ["ENGINE_OPTIONS", "SCALER_KEY", "Trainer"]

SCALER_KEY = "unidist.loss_scaler"  # an fp16 loss scale inside a checkpoint's extra

# Options only one engine understands, by name -> the backend that does (refused elsewhere).
ENGINE_OPTIONS: Mapping[str, str] = {"deepspeed_config": "deepspeed"}


class Trainer:
    """unidist's own data-parallel training over a Manager (or one of its Groups)."""

    def __init__(self, manager: TrainingWorld) -> None:
        self.mgr = manager
        self.prepared: Prepared | None = None  # the optimizer prepare returned last
        self.model: torch.nn.Module | None = None  # the user's module prepare saw last
        # every prepared module's optimizer (ZeRO stage 3 must find its optimizer from the module alone)
        self.prepared_for: weakref.WeakKeyDictionary[torch.nn.Module, Prepared] = weakref.WeakKeyDictionary()
        # the fingerprint of each prepared optimizer that records one (it observes the optimizer's steps)
        self.fingerprints: weakref.WeakKeyDictionary[Prepared, Fingerprint] = weakref.WeakKeyDictionary()
        self._following: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # _follow_forwards' hooked modules
        self.pending: SaveHandle | None = None  # the background save in flight (save_checkpoint(blocking=False))

    # ----------------------------------------------------------------- prepare
    def prepare(self, model: torch.nn.Module, optimizer: Any, request: PrepareRequest
                ) -> tuple[torch.nn.Module, Prepared]:
        """Check what only a started Manager can (see ``Manager.prepare``: the request is checked already), then
        build."""
        opts = request
        if opts.offload is not None:
            opts = dataclasses.replace(opts, offload=offload.effective(opts.offload, self.mgr.device, self.mgr.rank))
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"prepare(model=...) takes a torch.nn.Module, got {type(model).__name__}")
        for name, backend in ENGINE_OPTIONS.items():
            if getattr(opts, name) is not None and backend != self.mgr.name:
                raise InvalidArgumentError(
                    f"prepare({name}=...) is understood by the {backend} backend only, and this run uses "
                    f"{self.mgr.name}; pass it only when mgr.backend == {backend!r}"
                )
        for name in ("group", "clip_norm_group"):
            given = getattr(opts, name)
            if given is not None and not (isinstance(given, Group) and given.owner is self.mgr):
                raise InvalidArgumentError(f"prepare({name}=...) takes a Group made by this Manager's new_group() "
                                           f"or split(), got {given!r}")
        if opts.clip_norm_group is not None and opts.group is None:
            raise InvalidArgumentError("prepare(clip_norm_group=...) sums the clipping's norm over the model's other "
                                       "parts: pass group= (this part's data-parallel ranks) with it")
        if self.unwrap(model) in self.prepared_for:
            raise InvalidArgumentError(
                "prepare() was already called for this model: a second call would hook its gradients twice (or "
                "shard it again); prepare each model once, and keep using the model and optimizer it returned")
        self.model = model
        comm: Comm = opts.group if isinstance(opts.group, Group) else self.mgr
        # a MoE layer's experts are reduced over their own groups (comm/param_comm.py): unidist's optimizer does that
        experts = [p for p in model.parameters() if reduce_comm_of(p) is not None]
        own = opts.group is not None or bool(experts) or (opts.zero_stage and not self.engine_zero)
        if experts and opts.zero_stage:
            raise InvalidArgumentError(f"prepare(zero_stage={opts.zero_stage}) with Mixture-of-Experts layers: "
                                       "unidist's ZeRO does not shard expert parameters yet; use zero_stage=0 (the "
                                       "experts are already spread over the expert-parallel ranks)")
        if not (own and opts.zero_stage == 3):  # built partitioned (zero_init.py): only unidist's ZeRO-3 keeps it so
            zero_init.materialize(model.parameters())
        if own or not self.takes_sparse(opts):
            refuse_sparse(model)
        if opts.sync_batchnorm:
            model = convert_sync_batchnorm(model, comm)
        prepared, opt = self._prepare_unidist(model, optimizer, opts) if own else self._prepare(model, optimizer, opts)
        opt.observe(BufferSync(comm, self.unwrap(prepared)))  # rank 0's buffers everywhere after every step
        if opts.fingerprint is not None:
            fingerprint = self.fingerprints[opt] = self._fingerprint(opts, comm, self.unwrap(prepared), opt)
            opt.observe(fingerprint)
        self._follow_forwards()
        return prepared, opt

    def _fingerprint(self, opts: PrepareRequest, comm: Comm, model: torch.nn.Module, opt: Prepared) -> Fingerprint:
        """The fingerprint of this prepared model (fingerprint.py): the first model's at ``opts.fingerprint``."""
        header = {"backend": self.mgr.name, "world": self.mgr.size, "dp": comm.size, "device": str(self.mgr.device),
                  "zero_stage": opt.zero_stage, "precision": opts.precision, "clip": opt.clipping,
                  "accumulation": opt.backward_passes_per_step}
        made = Fingerprint(path_for(opts.fingerprint or ""), comm, header,
                           lambda: opt.fingerprint_parts(model, comm.rank, comm.size), model)
        made.attach(*verify_parts(self.mgr.config, model, list(model.named_parameters()),
                                  1.0 / comm.size if opts.op == ReduceOp.MEAN else 1.0))
        made.start()
        return made

    def _follow_forwards(self) -> None:
        """With two prepared models (a GAN, a teacher and a student) ``backward`` must serve the one whose loss it
        is: a forward pre-hook on each makes its optimizer (its accumulation, loss scale, DeepSpeed engine) the current
        one, so the model whose forward ran last is served. One prepared model needs no hook."""
        if len(self.prepared_for) < 2:
            return
        for module, opt in list(self.prepared_for.items()):
            if module not in self._following:
                self._following.add(module)
                module.register_forward_pre_hook(lambda _m, _args, opt=opt: self._serve(opt))

    def _serve(self, opt: Prepared) -> None:
        """Make ``opt`` (and its model) the one ``backward`` and the optimizer-less calls act on."""
        self.prepared = opt

    def takes_sparse(self, opts: PrepareRequest) -> bool:
        """Whether the engine's own training takes sparse gradients with these options (unidist's buckets and ZeRO
        shards never do; Horovod's optimizer allgathers them)."""
        return False

    engine_zero = False  # True where the engine shards itself (DeepSpeed): zero_stage goes to _prepare

    def _prepare(self, model: torch.nn.Module, optimizer: Any, opts: PrepareRequest
                 ) -> tuple[torch.nn.Module, Prepared]:
        """The backend's way; engines with their own training override this."""
        return self._prepare_unidist(model, optimizer, opts)

    def _prepare_unidist(self, model: torch.nn.Module, optimizer: Any, opts: PrepareRequest
                         ) -> tuple[torch.nn.Module, Prepared]:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"prepare(optimizer=...) takes a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        comm: Comm = opts.group if isinstance(opts.group, Group) else self.mgr
        if any(zero_init.is_partitioned(p) and zero_init.comm_of(p) is not comm for p in model.parameters()):
            raise InvalidArgumentError(  # every rank sees the same: refused before any collective, not a hang
                "prepare(zero_stage=3) of a model built with partitioned_build() over other ranks than prepare's "
                "group: pass the same group to both (partitioned_build(group=g) and prepare(..., group=g))")
        with zero_init.lightly(model):  # a parameter built partitioned is cast when made whole, not here
            model = model.to(self.mgr.device)
            hooks = self._apply_precision(model, opts)
        # rank 0's weights (built partitioned: rank 0's already); an expert's from the first rank holding the same
        # experts (its own group's root)
        plain, elsewhere = split_by_comm((item, item[1]) for item in model.state_dict(keep_vars=True).items()
                                         if not zero_init.is_partitioned(item[1]))
        broadcast_parameters(comm, plain)
        for mark, named in elsewhere:
            broadcast_parameters(mark.comm, named)
        broadcast_optimizer_state(comm, optimizer)
        wrapped: DistributedOptimizer | ZeroOptimizer
        precision = Precision.of(opts.precision)
        master = precision.master if precision.keeps_masters else None
        if opts.zero_stage:
            wrapped = ZeroOptimizer(comm, model, optimizer, opts.zero_stage, opts, offload=opts.offload is not None,
                                    master=master)
            zero_init.materialize(model.parameters())  # what ZeRO does not shard (frozen parameters) whole
        else:
            wrapped = DistributedOptimizer(comm, optimizer, model.named_parameters(), opts)
            if master is not None:
                wrapped.use_masters(master)
        wrapped.scaler = self._scaler(opts)
        wrapped.attach_hooks(hooks)
        self.prepared = wrapped
        self.prepared_for[model] = wrapped
        return model, wrapped

    def _apply_precision(self, model: torch.nn.Module, opts: PrepareRequest) -> list[Any]:
        """The forward of ``model`` follows ``opts.precision`` (autocast, or a bfloat16 model; see
        train/precision.py); returns the hooks that do it."""
        return Precision.of(opts.precision).apply(model, self.mgr.device)

    def _scaler(self, opts: PrepareRequest) -> LossScaler | None:
        """fp16's dynamic loss scale for an optimizer prepare builds, or None."""
        if not Precision.of(opts.precision).scaled:
            return None
        return LossScaler(opts.loss_scaling, self.mgr.device)

    # ----------------------------------------------------------------- the loop
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, divided by the accumulation passes and times the loss scale (fp16)."""
        opt = self.prepared
        if opt is not None:
            fingerprint = self.fingerprints.get(opt)
            if fingerprint is not None:
                fingerprint.add_loss(loss)
            k = opt.backward_passes_per_step
            loss = loss / k if k > 1 else loss
            if isinstance(opt.scaler, LossScaler):  # unidist's and Horovod's (DeepSpeed's engine scales itself)
                loss = opt.scaler.scale_loss(loss)
        if trace_hooks.active:  # the timeline: what bucket launches overlap (off, this bool test is all it costs)
            with trace_hooks.span("backward"):
                loss.backward()  # type: ignore[no-untyped-call]
        else:
            loss.backward()  # type: ignore[no-untyped-call]

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def accumulate(self, model: torch.nn.Module) -> Any:
        """``Manager.accumulate``: the block of the optimizer prepare returned for ``model``."""
        opt = self.prepared_for.get(self.unwrap(model))
        if opt is None:
            raise InvalidArgumentError("accumulate(model) takes a model prepare() returned (its optimizer holds "
                                       "the accumulated gradients); call mgr.prepare(model, opt) first")
        return opt.accumulate()

    def gathered_parameters(self, module: torch.nn.Module) -> Any:
        """Full parameters inside the block (ZeRO stage 3 gathers them; otherwise they are whole)."""
        opt = self.prepared_for.get(self.unwrap(module))
        if isinstance(opt, ZeroOptimizer):
            return opt.gathered()
        return contextlib.nullcontext()

    def partitioned_build(self, group: Any = None, enabled: bool = True) -> zero_init.PartitionedBuild:
        """Modules built inside are partitioned over ``group`` (the world) as built (zero_init.py)."""
        if group is not None and not (isinstance(group, Group) and group.owner is self.mgr):
            raise InvalidArgumentError(f"partitioned_build(group=...) takes a Group made by this Manager's "
                                       f"new_group() or split(), got {group!r}")
        return zero_init.PartitionedBuild(group if group is not None else self.mgr, enabled)

    # ----------------------------------------------------------------- what a rank holds
    def memory_stats(self) -> MemoryStats:
        """This rank's bytes for the prepared model (see unidist.train.memory)."""
        opt = self._need_prepared("memory_stats")
        model = self.unwrap(self.model) if self.model is not None else None
        params: list[torch.Tensor] = list(model.parameters()) if model is not None else []
        grads: list[Any] = [p.grad for p in params]
        if isinstance(opt, (ZeroOptimizer, DistributedOptimizer)):
            held, held_grads = opt.held_tensors()  # ZeRO's shards, the fusion buckets (they persist)
            params += held
            grads += held_grads
        return {"param_bytes": storage_bytes(params), "grad_bytes": storage_bytes(grads),
                "optimizer_bytes": storage_bytes(optimizer_tensors(opt.optimizer)),
                "peak_bytes": peak_bytes(self.mgr.device)}

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict as one process would hold it (copies), on every rank."""
        module = self.unwrap(model)
        with self.gathered_parameters(model):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state dict as one process would hold it, on every rank."""
        if isinstance(optimizer, ZeroOptimizer):
            return optimizer.full_state_dict()
        inner = optimizer.optimizer if isinstance(optimizer, Prepared) else optimizer
        return copy.deepcopy(inner.state_dict())  # type: ignore[no-any-return]

    # ----------------------------------------------------------------- checkpoints (unidist.checkpoint)
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        keep: int | None = None, extra: dict[str, Any] | None = None, blocking: bool = True,
                        loader: Any = None, format: str = "unidist") -> Path | SaveHandle:
        """``Manager.save_checkpoint``: the prepared optimizer's layout, written by unidist.checkpoint. An fp16 loss
        scale is saved with the optimizer (in ``extra``, under ``SCALER_KEY``), every rank's random generators and
        ``loader``'s position beside it (train/resume.py), all resumed by ``load_checkpoint``.
        A background save still in flight is published first (one in flight at a time, as torch's
        ``async_save``); ``blocking=False`` returns the new one's handle (unidist/checkpoint/background.py)."""
        if not isinstance(blocking, bool):
            raise InvalidArgumentError(f"save_checkpoint(blocking={blocking!r}) takes True or False")
        if format not in FORMATS:
            raise InvalidArgumentError(f"save_checkpoint(format={format!r}) takes 'unidist' (the default), 'dcp' "
                                       "(torch distributed checkpoint, as FSDP2 and DDP scripts load) or 'deepspeed' "
                                       "(what DeepSpeed's engine.load_checkpoint resumes from)")
        if format != "unidist" and (keep is not None or not blocking):
            raise InvalidArgumentError(f"save_checkpoint(format={format!r}) writes one directory, in the foreground: "
                                       "keep= and blocking=False apply to unidist's format")
        self.finish_pending()
        scaler = optimizer.scaler if isinstance(optimizer, Prepared) else None
        if scaler is not None:
            extra = {**(extra or {}), SCALER_KEY: scaler.state_dict()}
        # every rank's random generators and the loader's position (train/resume.py): a resumed run draws and
        # reads what the uninterrupted one would
        extra = {**(extra or {}), **resume.carried(self.mgr, loader)}
        layout = self.checkpoint_layout(model, optimizer)
        self._event("save", model, path)
        if format == "dcp":
            return save_dcp(self.mgr, path, layout, extra, first_names(self.unwrap(model)))
        if format == "deepspeed":
            module = self.unwrap(model)
            return save_deepspeed(self.mgr, path, layout, module, extra, first_names(module), self.mgr.allgather)
        if blocking:
            return checkpoint.save(self.mgr, path, layout, keep=keep, extra=extra)
        self.pending = save_async(self.mgr, path, layout, keep=keep, extra=extra)
        return self.pending

    def finish_pending(self) -> None:
        """Publish the background save in flight, if any and not yet waited for (a collective, as its
        ``wait()``): its error, if it failed, is raised here, once."""
        handle, self.pending = self.pending, None
        if handle is not None and not handle.finished:
            handle.wait()

    def close(self, failing: bool) -> None:
        """The Manager's shutdown, before its engine goes: publish a background save nobody waited for (every rank
        shuts down together, so its collective end runs in step); when the job is failing, give it up instead (its
        peers may be gone): the previous checkpoint stays the latest.

        Args:
            failing: the Manager is leaving on an error.
        """
        for fingerprint in list(self.fingerprints.values()):
            fingerprint.close()
        if self.pending is None:
            return
        if not failing:
            self.finish_pending()
            return
        self.pending.abandon()
        self.pending = None

    def load_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any = None, *,
                        loader: Any = None) -> dict[str, Any]:
        """``Manager.load_checkpoint``: returns the checkpoint's ``extra`` (the loss scale and every rank's random
        generators restored, not returned).
        A background save in flight is published first (it may be the checkpoint asked for)."""
        if loader is not None:
            resume.check_loader(loader, "load_checkpoint")  # before anything is read or changed
        self.finish_pending()
        self._event("load", model, path)
        extra = checkpoint.load(self.mgr, path, self.checkpoint_layout(model, optimizer))
        resume.restore(self.mgr, extra, loader, path)
        saved = extra.pop(SCALER_KEY, None)
        scaler = optimizer.scaler if isinstance(optimizer, Prepared) else None
        if saved is not None and scaler is not None:
            scaler.load_state_dict(saved)
        return extra

    def _event(self, kind: str, model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
        """A checkpoint of a fingerprinted model saved or loaded: a line in its fingerprint (verify reports it)."""
        opt = self.prepared_for.get(self.unwrap(model))
        fingerprint = self.fingerprints.get(opt) if opt is not None else None
        if fingerprint is not None:
            fingerprint.event(kind, path)

    def checkpoint_layout(self, model: torch.nn.Module, optimizer: Any = None) -> Layout:
        """What this rank holds of ``model`` (and ``optimizer``), from the optimizer that holds it: the one given,
        or for ``optimizer=None`` the one prepare returned for the model (ZeRO-3 shards the parameters
        themselves). An optimizer prepare did not make is whole on every rank."""
        module = self.unwrap(model)
        holder = optimizer if optimizer is not None else self.prepared_for.get(module)
        if isinstance(holder, Prepared):
            layout: Layout = holder.checkpoint_layout(module)
        else:
            layout = FullLayout(self.mgr.rank, self.mgr.size, module, holder)
        return layout if optimizer is not None else layout.without_optimizer()

    def _need_prepared(self, what: str) -> Any:
        if self.prepared is None:
            raise InvalidArgumentError(f"{what}() describes the prepared model; call mgr.prepare(model, opt) first")
        return self.prepared

    @staticmethod
    def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
        """``Manager.latest_checkpoint``: needs no Manager."""
        return checkpoint.latest_checkpoint(directory)

    # ----------------------------------------------------------------- building blocks
    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                              op: ReduceOp | str = ReduceOp.MEAN, compression: str | None = None,
                              backward_passes_per_step: int = 1, bucket_mb: float | None = None,
                              clip_grad_norm: float | None = None) -> torch.optim.Optimizer:
        """``Manager.distributed_optimizer``: the arguments checked once (``None`` takes the UNIDIST_* default),
        then the backend's optimizer (``_distributed_optimizer``)."""
        config = self.mgr.config
        sync = SyncOptions.parse(
            "distributed_optimizer", op=op, compression=compression if compression is not None else config.compression,
            backward_passes_per_step=backward_passes_per_step,
            bucket_mb=bucket_mb if bucket_mb is not None else config.bucket_mb, clip_grad_norm=clip_grad_norm)
        return self._distributed_optimizer(optimizer, named_parameters, sync)

    def _distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                               named_parameters: Iterable[tuple[str, torch.Tensor]] | None, sync: SyncOptions
                               ) -> torch.optim.Optimizer:
        """unidist's DistributedOptimizer over the world; engines with their own override this."""
        return DistributedOptimizer(self.mgr, optimizer, named_parameters, sync)

    def broadcast_parameters(self, model_or_state: Any, root: int = 0) -> None:
        broadcast_parameters(self.mgr, model_or_state, self.mgr.check_root(root))

    def broadcast_optimizer_state(self, optimizer: Any, root: int = 0) -> None:
        broadcast_optimizer_state(self.mgr, optimizer, self.mgr.check_root(root))

    def preemption(self, signals: Iterable[str | int], *, every: int, grace: float | None) -> Preemption:
        """``Manager.preemption``: the handlers installed (unidist/train/preempt.py)."""
        return Preemption(self.mgr, signals, every=every, grace=grace)

    def loader(self, dataset: Sized, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool, **kwargs: Any
               ) -> Loader:
        """``Manager.loader``: this rank's share of ``dataset``, batches on the Manager's device."""
        return Loader(dataset, rank=self.mgr.rank, size=self.mgr.size, device=self.mgr.device, batch_size=batch_size,
                      shuffle=shuffle, seed=seed, drop_last=drop_last, **kwargs)

    def shard(self, data: Sized | int, *, shuffle: bool, seed: int, drop_last: bool) -> ShardSampler:
        return ShardSampler(data, self.mgr.rank, self.mgr.size, shuffle=shuffle, seed=seed, drop_last=drop_last)


def refuse_sparse(model: torch.nn.Module) -> None:
    """An embedding with ``sparse=True`` makes sparse gradients, which unidist's fusion buckets and ZeRO shards (dense,
    flat) cannot carry: refused before anything changes, naming the module, rather than failing inside backward."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                and module.weight.requires_grad:
            raise InvalidArgumentError(
                f"prepare(): {name or 'the model'} is {type(module).__name__}(sparse=True), whose sparse gradients "
                "unidist's gradient buckets and ZeRO shards cannot reduce; build it with sparse=False (the default: "
                "the same update, as a dense gradient), or on the horovod backend use zero_stage=0 without group= and "
                "a precision without master copies, where Horovod's own optimizer allgathers sparse gradients")

