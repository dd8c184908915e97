"""DeepSpeed's own training behind ``prepare``: ``deepspeed.initialize`` from a config unidist generates
(unidist/train/ds_config.py: the engine defaults that change the math pinned, the user's config checked).

Everything else about the engine lives here, so a DeepSpeed upgrade is read in one file: the optimizer adapter,
memory accounting, consolidated optimizer state, and the engine's checkpoint layout (``DeepSpeedLayout``,
which reads the ZeRO optimizer's partitions through DeepSpeed's ``safe_get/set_full_*`` calls and, where those
fall short, a few of its private methods).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unidist.checkpoint.layout import (
    FullLayout,
    Layout,
    Pieces,
    Read,
    even_slice,
    fresh_scalars,
    param_names,
    per_element,
)
from unidist.comm import watchdog
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.train import ds_config
from unidist.train.memory import optimizer_tensors, peak_bytes, storage_bytes
from unidist.train.options import TrainOptions
from unidist.train.trainer import Trainer
from unidist.train.view import OptimizerView

__all__ = ["DeepSpeedLayout", "DeepSpeedTrainer", "EngineOptimizer"]


class EngineOptimizer(OptimizerView):
    """The engine's optimizer as a torch Optimizer: ``step()`` steps the engine (which knows the accumulation
    boundary and clears gradients after it); ``param_groups`` and ``state`` are the engine optimizer's, so LR
    schedulers drive what the engine steps."""

    def __init__(self, engine: Any, full_optimizer: Any, full_groups: list[list[torch.nn.Parameter]], world: Any
                 ) -> None:
        super().__init__(engine.optimizer)
        self.engine, self.world = engine, world
        self.full_optimizer = full_optimizer  # the user's optimizer, and its groups as one process holds them
        self.full_groups = full_groups

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
        with watchdog.watching("deepspeed engine.step"):
            self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine clears gradients itself after the step at each accumulation boundary, and
        clearing them between micro-batches would drop the accumulated part."""

    def synchronize(self) -> None:
        """Nothing to wait for: the engine averages gradients inside ``backward`` at the accumulation boundary."""

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

    def deepspeed_config(self, opts: TrainOptions | None = None) -> dict[str, Any]:
        """The DeepSpeed config ``prepare`` uses for ``opts``: engine defaults that change the math pinned
        (``NEUTRAL_CONFIG``), ``prepare``'s arguments mapped, then the user's config merged on top and checked
        (an unknown key is named, not ignored)."""
        from unidist.train.options import TrainOptions

        opts = opts if opts is not None else TrainOptions(zero_stage=self.mgr.config.zero_stage,
                                                          bucket_mb=self.mgr.config.bucket_mb)
        source = opts.deepspeed_config if opts.deepspeed_config is not None else self.mgr.config.deepspeed_config
        user = ds_config.load(source) if source is not None else None
        if user is not None and opts.clip_grad_norm is not None:
            clip = user.get("gradient_clipping")
            if clip is not None and float(clip) != opts.clip_grad_norm:
                raise InvalidArgumentError(
                    f"prepare(clip_grad_norm={opts.clip_grad_norm}) and the DeepSpeed config's gradient_clipping="
                    f"{clip} disagree; set one of them")
        cfg = ds_config.build(opts, self.mgr.size, user)
        if user is not None:
            ds_config.validate(cfg, user, source)
        return cfg

    def _prepare(self, model: torch.nn.Module, optimizer: Any, opts: TrainOptions) -> tuple[Any, EngineOptimizer]:
        """Build the DeepSpeed engine from ``deepspeed_config(opts)``: returns (engine, optimizer).

        ``backward_passes_per_step`` is DeepSpeed's gradient_accumulation_steps, ``compression`` its
        communication_data_type, ``clip_grad_norm`` its gradient_clipping; DeepSpeed only averages, so op
        must be 'mean'. ``optimizer`` may be None when the config has an 'optimizer' section."""
        if opts.op is not ReduceOp.MEAN:
            raise InvalidArgumentError("prepare(op='sum'): DeepSpeed averages gradients; use op='mean' on the "
                                       "deepspeed backend")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"prepare(optimizer=...) takes a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        config = self.deepspeed_config(opts)
        if int(config.get("zero_optimization", {}).get("stage", 0)) == 3 and any(
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
        # The user's RNG stream stays as it was (dropout masks must not depend on the backend).
        devices = [self.mgr._device] if self.mgr._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), watchdog.watching("deepspeed.initialize"):
            engine, _, _, _ = self.mgr._deepspeed.initialize(
                model=model.to(self.mgr.device), optimizer=optimizer, config=config,
                model_parameters=None if optimizer is not None else model.parameters())
        engine.__class__ = _module_keys(type(engine))
        self.engine = engine
        self.prepared = EngineOptimizer(engine, optimizer, self.full_groups, self.mgr)
        self.prepared_for[model] = self.prepared
        return engine, self.prepared

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module: a DeepSpeed engine's ``module``."""
        engine_cls = self.mgr._deepspeed.DeepSpeedEngine
        return model.module if isinstance(model, engine_cls) else model  # type: ignore[no-any-return]

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward`` after an engine was prepared: scales for accumulation and reduces or partitions
        gradients. After ``prepare(group=...)`` (unidist's optimizer) the plain path."""
        if isinstance(self.prepared, EngineOptimizer):
            with watchdog.watching("deepspeed engine.backward (gradient exchange)"):
                self.engine.backward(loss)
        else:
            super().backward(loss)

    def gathered_parameters(self, module: torch.nn.Module) -> Any:
        """Context manager giving full parameters even under ZeRO stage 3 (for checks and export)."""
        if not isinstance(self.prepared, EngineOptimizer):
            return super().gathered_parameters(module)
        return self.mgr._deepspeed.zero.GatheredParameters(list(module.parameters()))  # type: ignore[no-any-return]

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


class DeepSpeedLayout(Layout):
    """A DeepSpeed ZeRO engine: each parameter's full fp32 value and optimizer state assembled with
    DeepSpeed's safe_get_full_* (a collective, one parameter at a time) and set back with safe_set_full_*."""

    def __init__(self, rank: int, size: int, engine: Any, full_groups: list[list[torch.nn.Parameter]]) -> None:
        self.rank, self.size, self.engine, self.ranks = rank, size, engine, tuple(range(size))
        self.zero_stage = int(engine.zero_optimization_stage())
        self.module: torch.nn.Module = engine.module
        self.zero = engine.optimizer
        self.inner = self.zero.optimizer
        self.optimizer = self.inner
        names = param_names(self.module)
        self.shapes = {k: (tuple(getattr(v, "ds_shape", v.shape)), str(v.dtype))
                       for k, v in self.module.state_dict(keep_vars=True).items()}
        self.params = [p for g in full_groups for p in g]
        self.opt_names = [names[id(p)] for p in self.params]
        self.opt_groups = [gi for gi, g in enumerate(full_groups) for _ in g]
        found: tuple[Any, dict[str, Any]] = next(((q, st) for q, st in self.inner.state.items() if st), (None, {}))
        master, self.flat_state = found
        self.keys = sorted(k for k, v in self.flat_state.items()
                           if master is not None and per_element(v, master.shape))

    def pieces(self) -> Pieces:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        model: dict[str, Any] = {}
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        for k, v in self.module.state_dict(keep_vars=True).items():
            full = safe_get_full_fp32_param(v) if id(v) in by_id else None
            model[k] = even_slice(full if full is not None else v, self.rank, self.size)
        optim = {name: {key: even_slice(safe_get_full_optimizer_state(p, key), self.rank, self.size)
                        for key in self.keys} for p, name in zip(self.params, self.opt_names, strict=True)
                 } if self.optimizer is not None else {}
        return {"model": model, "optim": optim}

    def meta(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"param_groups": [], "scalars": {}}
        scalars = {k: v for k, v in self.flat_state.items() if k not in self.keys}
        return {"param_groups": self.settings(), "scalars": {name: scalars for name in self.opt_names}}

    def load(self, read: Read, meta: dict[str, Any], state_keys: dict[str, list[str]]) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_optimizer_state

        full = {k: read("model", k, "", 0, int(torch.Size(s).numel())).view(s) for k, (s, _) in self.shapes.items()}
        entries = self.module.state_dict(keep_vars=True)
        params = [v for v in entries.values() if isinstance(v, torch.nn.Parameter)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for k, v in entries.items():
                v.data.copy_(full[k].to(v.dtype))
        self.zero.refresh_fp32_params()  # the fp32 master partitions from the loaded parameters
        if self.optimizer is None:
            return
        saved = meta["scalars"].get(self.opt_names[0], {}) if self.opt_names else {}
        keys = sorted({k for name in self.opt_names for k in state_keys.get(name, [])})
        # A fresh engine has no optimizer state yet (it is made at the first step): make it, zeros, on the
        # fp32 master partitions, and have DeepSpeed link its per-parameter views into it.
        masters = getattr(self.zero, "single_partition_of_fp32_groups", None) or \
            getattr(self.zero, "fp32_partitioned_groups_flat", [])
        for q in masters:
            if not self.inner.state.get(q):
                self.inner.state[q] = {**{k: torch.zeros_like(q) for k in keys}, **fresh_scalars(saved)}
        if hasattr(self.zero, "_lazy_init_hp_params_optimizer_state"):
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()
        for p, name in zip(self.params, self.opt_names, strict=True):
            for key in state_keys.get(name, []):
                numel: int = getattr(p, "ds_numel", p.numel())  # stage 3 parameters are empty here
                if hasattr(p, "ds_id"):
                    self._set_stage3(p, read("optim", name, key, 0, numel), key)
                else:
                    safe_set_full_optimizer_state(p, read("optim", name, key, 0, p.numel()), key)
        for st in self.inner.state.values():
            for k, v in saved.items():
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v
        self.set_settings(meta["param_groups"])

    def _set_stage3(self, p: Any, value: torch.Tensor, key: str) -> None:
        """This rank's partition of a stage-3 parameter's optimizer state. DeepSpeed 0.19.8's own
        ``set_full_hp_param`` reads past the end of the value when the parameter's size is not a multiple of
        the world size (the last partition is padded), so the padding is added here."""
        part, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        padded = torch.zeros(part.numel() * self.size, dtype=value.dtype)
        padded[: value.numel()] = value.reshape(-1)
        rank = self.zero._get_param_partition_rank(p)
        part.data.copy_(padded[rank * part.numel():(rank + 1) * part.numel()])
