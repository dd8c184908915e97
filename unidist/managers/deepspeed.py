"""DeepSpeedManager: collectives through ``deepspeed.comm``, training through ``deepspeed.initialize``.

``deepspeed.comm`` mirrors torch.distributed, so every collective is TorchManager's; only start-up differs.
``prepare`` builds a DeepSpeed engine from a config unidist generates (or the user's), so the training loop
``mgr.backward(loss); opt.step(); opt.zero_grad()`` is the same as on every other backend.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from unidist.errors import BackendUnavailableError, ConfigError, InvalidArgumentError
from unidist.managers.torch import TorchManager
from unidist.ops import ReduceOp, resolve_op

__all__ = ["DeepSpeedManager", "EngineOptimizer"]

PIP_HINT = "pip install 'unidist[deepspeed]'"


class EngineOptimizer:
    """What ``prepare`` returns as the optimizer: ``step()`` steps the engine (which knows the accumulation
    boundary and clears gradients after it); anything else reads through to the wrapped optimizer."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise InvalidArgumentError("a DeepSpeed engine step takes no closure")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine clears gradients itself after the step at each accumulation boundary, and
        clearing them between micro-batches would drop the accumulated part."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine.optimizer, name)


class DeepSpeedManager(TorchManager):
    """deepspeed.comm process group; ``prepare`` builds a DeepSpeed engine."""

    name = "deepspeed"

    def _import_dist(self) -> Any:
        try:
            import deepspeed
            import deepspeed.comm as ds_comm
        except ImportError as err:
            raise BackendUnavailableError(f"the 'deepspeed' backend needs deepspeed ({err}); {PIP_HINT}") from err
        if self.config.log_level != "DEBUG":  # DeepSpeed warns about every untested optimizer otherwise
            deepspeed.utils.logger.setLevel(max(logging.ERROR, logging.getLevelName(self.config.log_level)))
        self._deepspeed = deepspeed
        return ds_comm

    def _init_group(self) -> None:
        if self._process_group_backend() == "gloo":
            # init_distributed JIT-compiles a shared-memory op (~2 min on first use) that only DeepSpeed's
            # inference_all_reduce needs; unidist never calls it, so mark it unavailable before init.
            ops = getattr(self._deepspeed, "ops", None)
            compatible = getattr(ops, "__compatible_ops__", None)
            if isinstance(compatible, dict):
                compatible["deepspeed_shm_comm"] = False
        self._dist.init_distributed(dist_backend=self._process_group_backend(), auto_mpi_discovery=False,
                                    verbose=False, init_method="env://",
                                    timeout=datetime.timedelta(seconds=self.config.timeout))

    # ------------------------------------------------------------ training
    def deepspeed_config(self, *, zero_stage: int | None = None, micro_batch_size: int = 1,
                         gradient_accumulation_steps: int = 1, gradient_clipping: float | None = None,
                         precision: str = "fp32", bucket_mb: float | None = None,
                         user_config: Mapping[str, Any] | str | Path | None = None) -> dict[str, Any]:
        """The DeepSpeed config ``prepare`` uses: unidist's settings, then the user's config on top."""
        stage = self.config.zero_stage if zero_stage is None else zero_stage
        if stage not in (0, 1, 2, 3):
            raise InvalidArgumentError(f"zero_stage={stage!r}; use 0, 1, 2 or 3")
        if precision not in ("fp32", "fp16", "bf16"):
            raise InvalidArgumentError(f"precision={precision!r}; use fp32, fp16 or bf16")
        if micro_batch_size < 1 or gradient_accumulation_steps < 1:
            raise InvalidArgumentError("micro_batch_size and gradient_accumulation_steps must be >= 1")
        bucket = int((self.config.bucket_mb if bucket_mb is None else bucket_mb) * 2**20 / 4)  # elements
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "train_batch_size": micro_batch_size * gradient_accumulation_steps * self.size,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
            "fp16": {"enabled": precision == "fp16"},
            "bf16": {"enabled": precision == "bf16"},
            "zero_allow_untested_optimizer": True,  # any torch optimizer, as on every other backend
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if gradient_clipping is not None:
            cfg["gradient_clipping"] = float(gradient_clipping)
        source = user_config if user_config is not None else self.config.deepspeed_config
        if source is not None:
            user = _load_config(source)
            _merge(cfg, user)
            if "train_batch_size" in user:  # the user's batch arithmetic wins; DeepSpeed derives the rest
                if "train_micro_batch_size_per_gpu" not in user:
                    cfg.pop("train_micro_batch_size_per_gpu")
            else:
                cfg["train_batch_size"] = (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
                                           * self.size)
        return cfg

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                zero_stage: int | None = None, config: Mapping[str, Any] | str | Path | None = None,
                micro_batch_size: int = 1, gradient_accumulation_steps: int | None = None,
                gradient_clipping: float | None = None, precision: str = "fp32",
                bucket_mb: float | None = None, **opts: Any) -> tuple[Any, EngineOptimizer]:
        """Build the DeepSpeed engine: returns (engine, optimizer) for ``loss = engine(x) ...;
        mgr.backward(loss); opt.step(); opt.zero_grad()``. ``config`` (dict or JSON path, default
        UNIDIST_DEEPSPEED_CONFIG) overrides what unidist generates. The contract's optimizer keywords map to
        DeepSpeed's: backward_passes_per_step -> gradient_accumulation_steps, compression ->
        communication_data_type; DeepSpeed averages gradients, so op must be 'mean'."""
        self._need_started()
        k = opts.pop("backward_passes_per_step", None)
        compression = opts.pop("compression", None) or self.config.compression
        op = resolve_op(opts.pop("op", ReduceOp.MEAN))
        if opts:
            raise InvalidArgumentError(f"prepare() got unknown options {sorted(opts)} on the deepspeed backend")
        if op is not ReduceOp.MEAN:
            raise InvalidArgumentError("DeepSpeed averages gradients; prepare(op=...) must be 'mean' here")
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = k or 1
        ds_config = self.deepspeed_config(zero_stage=zero_stage, micro_batch_size=micro_batch_size,
                                          gradient_accumulation_steps=gradient_accumulation_steps,
                                          gradient_clipping=gradient_clipping, precision=precision,
                                          bucket_mb=bucket_mb, user_config=config)
        if compression != "none":
            ds_config.setdefault("communication_data_type", compression)
        if optimizer is None and "optimizer" not in ds_config:
            raise InvalidArgumentError("prepare() needs an optimizer, or an 'optimizer' section in the config")
        engine, ds_optimizer, _, _ = self._deepspeed.initialize(
            model=model.to(self.device), optimizer=optimizer, config=ds_config,
            model_parameters=None if optimizer is not None else model.parameters())
        self._engine = engine
        del ds_optimizer
        return engine, EngineOptimizer(engine)

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward``: scales for accumulation and reduces or partitions gradients."""
        engine = getattr(self, "_engine", None)
        if engine is None:
            raise InvalidArgumentError("backward() comes after prepare(model, optimizer) on the deepspeed backend")
        engine.backward(loss)

    def gathered_parameters(self, module: torch.nn.Module) -> Iterator[Any]:
        """Context manager giving full parameters even under ZeRO stage 3 (for checks and export)."""
        return self._deepspeed.zero.GatheredParameters(list(module.parameters()))  # type: ignore[no-any-return]


def _load_config(source: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    path = Path(source)
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {str(path)!r} (UNIDIST_DEEPSPEED_CONFIG or config=) does not exist")\
            from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"DeepSpeed config {str(path)!r} must hold a JSON object")
    return loaded


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
