"""DeepSpeed's own training behind ``prepare``: ``deepspeed.initialize`` from a config unidist generates
(unidist/engines/deepspeed/config.py: the engine defaults that change the math pinned, the user's config checked).

The engine's adapter lives here: the optimizer view, precision, accumulation, memory accounting and consolidated
optimizer state; beside it, each with one job, ``config.py`` (the config), ``scaler.py`` (fp16's agreed
GradScaler) and ``layout.py`` (the checkpoint layout). A DeepSpeed upgrade is read in these four files.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from unidist.checkpoint.layout import FullLayout, Layout
from unidist.comm import timeline
from unidist.engines.deepspeed import config as ds_config
from unidist.engines.deepspeed import reducer as ds_reducer
from unidist.engines.deepspeed.layout import DeepSpeedLayout
from unidist.engines.deepspeed.scaler import AgreedGradScaler
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.request import PrepareRequest, check_offload
from unidist.train.fingerprint import slice_squares
from unidist.train.memory import optimizer_tensors, peak_bytes, storage_bytes
from unidist.train.precision import Precision, cast_floats
from unidist.train.prepared import Prepared, one_way_to_accumulate
from unidist.train.reducer import GradientReducer
from unidist.train.trainer import Trainer

__all__ = ["AgreedGradScaler", "DeepSpeedLayout", "DeepSpeedTrainer", "EngineOptimizer"]  # the first two re-exported


class EngineOptimizer(Prepared):
    """The engine's optimizer as a torch Optimizer: ``step()`` steps the engine (which knows the accumulation
    boundary and clears gradients after it); ``param_groups`` and ``state`` are the engine optimizer's, so LR
    schedulers drive what the engine steps."""

    scaler: AgreedGradScaler | None = None

    def __init__(self, engine: Any, full_optimizer: Any, full_groups: list[list[torch.nn.Parameter]], world: Any
                 ) -> None:
        super().__init__(engine.optimizer)
        self.engine, self.world = engine, world
        self.full_optimizer = full_optimizer  # the user's optimizer, and its groups as one process holds them
        self.full_groups = full_groups
        self.scaler = None  # fp16-mixed's loss scale (installed by DeepSpeedTrainer)
        self._hooks: list[Any] = []  # the precision's forward hooks on the user's module
        # unidist's buckets in place of the engine's allreduce at stage 0 (prepare(reducer=...)), or None; drained
        # by synchronize() or the step at the accumulation boundary, once (_synced)
        self.reducer: GradientReducer | None = None
        self._synced = False
        self._grad_sq = 0.0  # the fingerprint's gradient before the engine's step (stage 0)

    def attach_hooks(self, hooks: list[Any]) -> None:
        """Hooks this optimizer's ``remove_hooks()`` detaches too (the precision's, the stage-0 reducer's)."""
        self._hooks += hooks

    def remove_hooks(self) -> None:
        """Detach the precision's forward hooks from the user's module (the engine itself keeps running)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # OptimizerView's loss-scale report, and DeepSpeed's own where a user config enabled its fp16 section; real
    # properties, so __getattr__ does not forward them to the engine's optimizer
    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without loss scaling)."""
        if self.scaler is not None:
            return super().loss_scale
        scale = getattr(self.engine.optimizer, "loss_scale", None)  # DeepSpeed's own fp16 section
        return float(scale) if isinstance(scale, (int, float, torch.Tensor)) else 1.0

    @property
    def last_step_skipped(self) -> bool:
        """The last optimizer step found inf/nan gradients and was not applied (the same on every rank)."""
        if self.scaler is not None:
            return super().last_step_skipped
        return not getattr(self.engine, "_step_applied", True)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/nan gradients so far."""
        if self.scaler is not None:
            return super().skipped_steps
        return int(getattr(self.engine, "skipped_steps", 0))

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm DeepSpeed measured at the last step (None where it measures none: fp32 stage 0
        without clipping)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    @property
    def backward_passes_per_step(self) -> int:
        """The engine's gradient_accumulation_steps (a user DeepSpeed config may have set it)."""
        return int(self.engine.gradient_accumulation_steps())

    @property
    def zero_optimizer(self) -> Any:
        """The engine's ZeRO optimizer (None at stage 0, where the engine steps the user's optimizer)."""
        engine_opt = self.engine.optimizer
        return engine_opt if engine_opt is not self.full_optimizer else None

    def checkpoint_layout(self, model: torch.nn.Module) -> Layout:
        """Under ZeRO the engine's partitions, assembled with DeepSpeed's calls; at stage 0 the user's optimizer,
        whole on every rank."""
        if self.zero_optimizer is not None:
            return DeepSpeedLayout(self.world.rank, self.world.size, self.engine, self.full_groups)
        return FullLayout(self.world.rank, self.world.size, self.engine.module, self.full_optimizer)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise InvalidArgumentError("a DeepSpeed engine step takes no closure")
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary:
            self.synchronize()  # unidist's reducer, if any, before the engine clips and steps
            self._synced = False
        scaler = self.scaler if boundary else None
        if scaler is not None:
            scaler.begin_step()
            if scaler.engine_unscales:  # DeepSpeed divides by its loss scale where it clips: make it this one
                self.engine.optimizer.loss_scaler.cur_scale = scaler.scale_value
        if boundary:
            self._begin_step()  # the averaged gradient, before the engine clips and steps it
        try:
            with timeline.watching("deepspeed engine.step"):
                self.engine.step()
        except BaseException:
            if scaler is not None:
                scaler.abandon_step()
            raise
        if scaler is not None:
            zero = self.zero_optimizer
            scaler.end_step(bool(getattr(zero, "overflow", False)) if zero is not None else False)
        if boundary:
            self._end_step()

    @property
    def clipping(self) -> float | None:
        """The engine's gradient clipping (its config's ``gradient_clipping``; 0 is none)."""
        clip = float(self.engine.gradient_clipping())
        return clip if clip > 0 else None

    @property
    def zero_stage(self) -> int:
        """The engine's ZeRO stage (its config's, which a user config may set)."""
        return int(self.engine.zero_optimization_stage())

    def _fingerprint_grads(self, rank: int, size: int) -> tuple[float, bool]:
        """The engine's own global norm before its clipping where it measured one (ZeRO, or clipping), else this
        rank's slice of the averaged gradient every rank held before the engine's step (stage 0)."""
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            return float(norm) ** 2, False
        return self._grad_sq, True

    def fingerprint_parts(self, model: torch.nn.Module, rank: int, size: int
                          ) -> tuple[list[str], dict[str, tuple[int, torch.Tensor]]]:
        """At stage 3 each parameter's own partition (``ds_tensor``: disjoint, rank r's holds elements r*P to
        (r+1)*P), no gather, without its padding: DeepSpeed makes a partition with ``torch.empty`` and copies only
        the elements that exist, so the last rank's tail of a parameter whose size the ranks do not divide holds
        whatever the memory held (BERT's 3-element classifier bias read 0.018 there); below stage 3 every rank holds
        the module's parameters whole (the engine all-gathers them after its step)."""
        names, parts = super().fingerprint_parts(model, rank, size)
        for k, v in model.state_dict(keep_vars=True).items():
            partition = getattr(v, "ds_tensor", None)
            if partition is not None:
                flat = partition.detach().reshape(-1)
                own = max(0, min(flat.numel(), int(getattr(v, "ds_numel", flat.numel())) - rank * flat.numel()))
                parts[k] = (rank * flat.numel(), flat[:own])
        return names, parts

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine clears gradients itself after the step at each accumulation boundary, and
        clearing them between micro-batches would drop the accumulated part."""

    @contextmanager
    def accumulate(self) -> Iterator[None]:
        """``Manager.accumulate`` with DeepSpeed's own means: at ZeRO 1-3 ``engine.coalesce_grad_reduction()`` (the
        backward passes keep their gradients local; leaving it reduces them once), at stage 0 ``engine.no_sync()``
        and then one ``engine.allreduce_gradients()``. At ZeRO-3 DeepSpeed's forward still fetches parameters."""
        one_way_to_accumulate(self.backward_passes_per_step, "gradient_accumulation_steps")
        if int(self.engine.zero_optimization_stage()) == 0:
            with self.engine.no_sync():
                yield
            if self.reducer is not None:
                self.synchronize()
                return
            with timeline.watching("deepspeed engine.allreduce_gradients (gradient exchange)"):
                self.engine.allreduce_gradients()
            return
        block = self.engine.coalesce_grad_reduction()
        block.__enter__()
        try:
            yield
        except BaseException as err:
            block.__exit__(type(err), err, err.__traceback__)
            raise
        with timeline.watching("deepspeed coalesce_grad_reduction (gradient exchange)"):
            block.__exit__(None, None, None)

    def synchronize(self) -> None:
        """With unidist's reducer (``prepare(reducer=...)``), finish its buckets: the averaged gradients are then in
        ``p.grad`` and the next ``step()`` uses them as they are. Otherwise nothing to wait for: the engine averages
        gradients inside ``backward`` at the accumulation boundary."""
        if self.reducer is not None and not self._synced:
            self.reducer.synchronize()
            self._synced = True

    def hold_gradient_norm(self, rank: int, size: int) -> None:
        """The engine clears its gradients in its step: this rank's even slice of the averaged gradient's squares,
        taken before (read at stage 0; under ZeRO the engine measures the norm itself)."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        self._grad_sq = slice_squares(grads, rank, size)

    def __getattr__(self, name: str) -> Any:  # engine-specific attributes such as loss_scale
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.__dict__["_inner"], name)


class DeepSpeedTrainer(Trainer):
    """A DeepSpeed engine per ``prepare``; with ``group=`` unidist's own optimizer over that group."""

    engine: Any = None
    full_optimizer: Any = None  # the user's optimizer, and its groups as one process holds them
    full_groups: list[list[torch.nn.Parameter]]
    engine_zero = True  # zero_stage is the engine's own ZeRO

    def deepspeed_config(self, opts: PrepareRequest | None = None) -> dict[str, Any]:
        """The DeepSpeed config ``prepare`` uses for ``opts``: engine defaults that change the math pinned
        (``NEUTRAL_CONFIG``), ``prepare``'s arguments mapped, then the user's config merged on top and checked
        (an unknown key is named, not ignored; a setting both set differently is a ConfigError)."""
        return self._resolve(opts)[1]

    def _resolve(self, opts: PrepareRequest | None) -> tuple[PrepareRequest, dict[str, Any]]:
        """(the options the engine runs: ``opts`` with what the user's config set where prepare kept a default,
        the config)."""
        opts = opts if opts is not None else PrepareRequest(zero_stage=self.mgr.config.zero_stage,
                                                            bucket_mb=self.mgr.config.bucket_mb)
        from_env = opts.deepspeed_config is None
        source = opts.deepspeed_config if not from_env else self.mgr.config.deepspeed_config
        user = ds_config.load(source) if source is not None else None
        if user is not None and source is not None:
            opts = ds_config.check_agreement(opts, user, source, env=from_env)
        cfg = ds_config.build(opts, self.mgr.size, user)
        if user is not None and source is not None:
            ds_config.validate(cfg, user, source)
        return opts, cfg

    def _prepare(self, model: torch.nn.Module, optimizer: Any, opts: PrepareRequest) -> tuple[Any, EngineOptimizer]:
        """Build the DeepSpeed engine from ``deepspeed_config(opts)``: returns (engine, optimizer).

        ``backward_passes_per_step`` is DeepSpeed's gradient_accumulation_steps, ``compression`` its
        communication_data_type, ``clip_grad_norm`` its gradient_clipping, ``precision`` its torch_autocast
        (ds_config.precision_section); DeepSpeed only averages, so op must be 'mean'. ``optimizer`` may be None
        when the config has an 'optimizer' section."""
        if opts.op is not ReduceOp.MEAN:
            raise InvalidArgumentError("prepare(op='sum'): DeepSpeed averages gradients; use op='mean' on the "
                                       "deepspeed backend")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"prepare(optimizer=...) takes a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        opts, config = self._resolve(opts)
        stage = int(config["zero_optimization"].get("stage", 0))
        check_offload(opts.offload, stage)  # the stage a DeepSpeed config set is known now
        precision = Precision.of(opts.precision)
        self._check_precision(precision, stage)
        if stage == 3 and any(
                isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules()):
            # DeepSpeed's ZeRO-3 hooks fail inside a compiled module ('dict' object has no attribute '_in_forward')
            raise InvalidArgumentError(
                "prepare(zero_stage=3) on the deepspeed backend cannot take a torch.compile()d module: DeepSpeed's "
                "ZeRO-3 parameter hooks do not run inside it; prepare the eager module and compile what prepare "
                "returns (torch.compile(engine)), or compile at zero_stage 0-2")
        self.full_optimizer = optimizer
        self.full_groups = [list(g["params"]) for g in optimizer.param_groups] if optimizer is not None else []
        if optimizer is None and "optimizer" not in config:
            raise InvalidArgumentError("prepare() needs an optimizer, or an 'optimizer' section in deepspeed_config")
        model = model.to(self.mgr.device)
        # bf16-true, bf16-master: the bfloat16 model and its input/output casts (DeepSpeed's bf16 section keeps the
        # master copies); mixed: DeepSpeed's autocast runs the forward, the outputs come back as float32 as everywhere
        hooks = precision.apply(model, self.mgr.device) if precision.param_dtype is not None else []
        if precision.mixed:
            hooks.append(model.register_forward_hook(_outputs_float32))
        _reset_autocast_state()
        # The user's RNG stream stays as it was (dropout masks must not depend on the backend).
        devices = [self.mgr.device] if self.mgr.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), timeline.watching("deepspeed.initialize"):
            engine, _, _, _ = self.mgr.engine_api.initialize(
                model=model, optimizer=optimizer, config=config,
                model_parameters=None if optimizer is not None else model.parameters())
        engine.__class__ = _module_keys(type(engine))
        self.engine = engine
        self.prepared = EngineOptimizer(engine, optimizer, self.full_groups, self.mgr)
        self.prepared.attach_hooks(hooks)
        if ds_reducer.wanted(opts, config, stage, user_config=self.mgr.config.deepspeed_config):
            self.prepared.reducer = ds_reducer.install(engine, self.mgr, opts.bucket_mb * 2**20)
            self.prepared.attach_hooks(self.prepared.reducer.hooks)
        self._install_scaler(self.prepared, precision, opts)
        self.prepared_for[model] = self.prepared
        return engine, self.prepared

    @staticmethod
    def _check_precision(precision: Precision, stage: int) -> None:
        """What DeepSpeed 0.19.8 cannot run with unidist's meaning is refused, saying what to use instead."""
        if precision.param_dtype is not None and not precision.keeps_masters and stage:
            raise InvalidArgumentError(
                f"prepare(precision={precision.name!r}) is not available on the deepspeed backend at ZeRO stage "
                f"{stage}: DeepSpeed's ZeRO optimizer keeps float32 master copies of a bfloat16 model (its "
                "'bf16' section's meaning, which is precision='bf16-master'). Use precision='bf16-master' or "
                "'bf16-mixed', or zero_stage=0, or prepare(group=...) (unidist's ZeRO, which runs bf16-true)")

    def _install_scaler(self, prepared: EngineOptimizer, precision: Precision, opts: PrepareRequest) -> None:
        """fp16-mixed: DeepSpeed's default GradScaler replaced by ``AgreedGradScaler`` with ``opts.loss_scaling``;
        otherwise none (a GradScaler a previous engine's autocast state left behind is removed)."""
        engine = prepared.engine
        zero = prepared.zero_optimizer
        scaler = None
        if precision.scaled:
            group = zero.dp_process_group if zero is not None else getattr(engine, "data_parallel_group", None)
            scaler = AgreedGradScaler(opts.loss_scaling, self.mgr.device, group)
            scaler.engine_unscales = zero is not None and float(engine.gradient_clipping() or 0.0) > 0
        if zero is not None:
            zero.torch_autocast_gradscaler = scaler
        else:
            engine.torch_autocast_z0_gradscaler = scaler
        prepared.scaler = scaler

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module: a DeepSpeed engine's ``module``."""
        engine_cls = self.mgr.engine_api.DeepSpeedEngine
        return model.module if isinstance(model, engine_cls) else model  # type: ignore[no-any-return]

    def _serve(self, opt: Prepared) -> None:
        super()._serve(opt)
        if isinstance(opt, EngineOptimizer):  # its engine's backward, then
            self.engine = opt.engine

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward`` after an engine was prepared: scales for accumulation and reduces or partitions
        gradients. After ``prepare(group=...)`` (unidist's optimizer) the plain path."""
        if isinstance(self.prepared, EngineOptimizer):
            fingerprint = self.fingerprints.get(self.prepared)
            if fingerprint is not None:
                fingerprint.add_loss(loss)
            with timeline.watching("deepspeed engine.backward (gradient exchange)"):
                self.engine.backward(loss)
        else:
            super().backward(loss)

    def gathered_parameters(self, module: torch.nn.Module) -> Any:
        """Context manager giving full parameters even under ZeRO stage 3 (for checks and export)."""
        if not isinstance(self.prepared, EngineOptimizer):
            return super().gathered_parameters(module)
        return self.mgr.engine_api.zero.GatheredParameters(list(module.parameters()))  # type: ignore[no-any-return]

    # ----------------------------------------------------------------- what a rank holds, consolidated state
    def _zero_optimizer(self) -> Any:
        """The engine's ZeRO optimizer (None at stage 0, where the engine steps the user's optimizer)."""
        return self.prepared.zero_optimizer if isinstance(self.prepared, EngineOptimizer) else None

    def memory_stats(self) -> dict[str, int]:
        """As ``Trainer.memory_stats``, from the engine: stage 3 parameters are their ``ds_tensor``
        partitions; the fp32 master partitions the engine's inner optimizer steps count as optimizer state
        (the ZeRO paper's accounting), their gradients and ``averaged_gradients`` as gradients."""
        if not isinstance(self.prepared, EngineOptimizer):
            return super().memory_stats()
        module = self.engine.module
        params: list[Any] = []
        grads: list[Any] = []
        for p in module.parameters():
            params.append(getattr(p, "ds_tensor", None))
            params.append(p)
            grads.append(p.grad)
        zero = self._zero_optimizer()
        inner = zero.optimizer if zero is not None else self.engine.optimizer
        masters = [*{id(q): q for q in [*(q for g in inner.param_groups for q in g["params"]), *inner.state]}.values()
                   ] if zero is not None else []
        grads += [q.grad for q in masters]
        for value in (getattr(zero, "averaged_gradients", None) or {}).values() if zero is not None else ():
            grads += list(value) if isinstance(value, list) else [value]
        return {"param_bytes": storage_bytes(params), "grad_bytes": storage_bytes(grads),
                "optimizer_bytes": storage_bytes([*masters, *optimizer_tensors(inner)]),
                "peak_bytes": peak_bytes(self.mgr.device)}

    def full_optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """One process's ``state_dict()``: at stage 0 the user's optimizer's; under ZeRO assembled from the
        engine's partitions with DeepSpeed's ``safe_get_full_optimizer_state`` (a collective)."""
        zero = self._zero_optimizer() if isinstance(optimizer, EngineOptimizer) else None
        if zero is None:
            return super().full_optimizer_state_dict(optimizer)
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = zero.optimizer
        # keyed by the fp32 master partitions (stage 3 empties the inner param_groups between steps)
        master, flat_state = next(((q, st) for q, st in inner.state.items() if st), (None, {}))
        per_element = sorted(k for k, v in flat_state.items()
                             if isinstance(v, torch.Tensor) and master is not None and v.shape == master.shape)
        scalars = {k: v for k, v in flat_state.items() if k not in per_element}
        state: dict[int, dict[str, Any]] = {}
        params = [p for g in self.full_groups for p in g]
        for i, p in enumerate(params):
            entry: dict[str, Any] = {}
            for key in per_element:
                full = safe_get_full_optimizer_state(p, key)
                if full is not None:
                    entry[key] = full.detach().clone().view(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
            if entry:
                entry.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()})
                state[i] = entry
        groups, start = [], 0
        for g, members in zip(inner.param_groups, self.full_groups, strict=True):
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(members)))})
            start += len(members)
        return {"state": state, "param_groups": groups}


def _outputs_float32(module: torch.nn.Module, args: Any, out: Any) -> Any:
    """The forward's floating outputs as float32 (the loss is then computed in float32, as on every backend)."""
    return cast_floats(out, torch.float32)


def _reset_autocast_state() -> None:
    """DeepSpeed 0.19.8 keeps "torch_autocast initialised" and its dtype in module globals that the first engine
    with torch_autocast sets and nothing clears: a later engine without it would then build a GradScaler from the
    earlier engine's dtype. Each engine starts from a clean slate (the engine's init sets them again if its
    config enables torch_autocast)."""
    import deepspeed.runtime.torch_autocast as autocast_state

    autocast_state.TORCH_AUTOCAST_INITIALIZED = False
    autocast_state.TORCH_AUTOCAST_DTYPE = None


_KEYED: dict[type, type] = {}


def _module_keys(engine_cls: type) -> type:
    """The engine's class with ``state_dict``/``load_state_dict`` of the user's module, so the prepared model's
    keys equal the user's model's on every backend (an engine would prefix them with ``module.``)."""
    cls = _KEYED.get(engine_cls)
    if cls is None:
        def state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.module.state_dict(*args, **kwargs)

        def load_state_dict(self: Any, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
                            ) -> Any:
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        cls = type(engine_cls.__name__, (engine_cls,), {"state_dict": state_dict, "load_state_dict": load_state_dict,
                                                         "__module__": engine_cls.__module__})
        _KEYED[engine_cls] = cls
    return cls
