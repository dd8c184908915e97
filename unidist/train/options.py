"""The arguments of ``Manager.prepare``, validated once, before anything changes, for every backend.

One signature on every backend is what lets a script move between launchers: every keyword has the same
meaning everywhere, an unknown one is an error naming ``prepare`` and the accepted names, and an option
only one engine understands carries that engine's name (``deepspeed_config``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unidist.config import COMPRESSIONS
from unidist.errors import ConfigError, InvalidArgumentError
from unidist.ops import ReduceOp, resolve_op
from unidist.train import offload as offload_
from unidist.train.precision import Precision, ScalerOptions

if TYPE_CHECKING:
    from unidist.config import Config

__all__ = ["PREPARE_ARGS", "REDUCERS", "SyncOptions", "TrainOptions"]

# prepare(reducer=...): who averages the gradients on an engine with a reducer of its own (DeepSpeed, Horovod)
REDUCERS = ("auto", "engine", "unidist")


def _check_sync_op(op: ReduceOp | str, where: str) -> ReduceOp:
    """Gradients are averaged or summed; min/max/product make no sense for them."""
    try:
        rop = resolve_op(op)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{where}(op={op!r}): {err}") from None
    if rop not in (ReduceOp.MEAN, ReduceOp.SUM):
        raise InvalidArgumentError(f"{where}(op={rop.value!r}): gradients are combined with 'mean' or 'sum'")
    return rop


def _check_compression(compression: str, where: str) -> str:
    if compression not in COMPRESSIONS:
        raise InvalidArgumentError(f"{where}(compression={compression!r}); use one of {', '.join(COMPRESSIONS)}")
    return compression


def _check_passes(k: object, where: str) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidArgumentError(f"{where}(backward_passes_per_step={k!r}) must be an int >= 1")
    return k


def one_way_to_accumulate(k: int, name: str = "backward_passes_per_step") -> None:
    """``accumulate()`` blocks and a window of k backward passes per step are two ways to accumulate; one prepared
    optimizer takes one of them (the window would count the block's passes as its own)."""
    if k > 1:
        raise InvalidArgumentError(f"accumulate() with {name}={k}: use one of the two ways to accumulate, "
                                   f"accumulate() blocks or {name}, not both")


def _check_bucket_mb(mb: object, where: str) -> float:
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not (mb > 0 and math.isfinite(mb)):
        raise InvalidArgumentError(f"{where}(bucket_mb={mb!r}) must be a positive number of MiB")
    return float(mb)


def _check_clip(clip: object, where: str) -> float | None:
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (clip > 0 and math.isfinite(clip)):
        raise InvalidArgumentError(f"{where}(clip_grad_norm={clip!r}) must be a positive finite number, or None "
                                   "for no clipping")
    return float(clip)


@dataclass(frozen=True)
class SyncOptions:
    """How gradients are reduced, checked once (by ``parse``); the optimizers trust what they are given."""

    op: ReduceOp = ReduceOp.MEAN
    compression: str = "none"
    backward_passes_per_step: int = 1
    bucket_mb: float = 25.0
    clip_grad_norm: float | None = None

    @classmethod
    def parse(cls, where: str, *, op: ReduceOp | str, compression: str, backward_passes_per_step: int,
              bucket_mb: float, clip_grad_norm: float | None) -> SyncOptions:
        """The one place these arguments are validated; ``where`` names the call in error messages."""
        return cls(op=_check_sync_op(op, where), compression=_check_compression(compression, where),
                   backward_passes_per_step=_check_passes(backward_passes_per_step, where),
                   bucket_mb=_check_bucket_mb(bucket_mb, where), clip_grad_norm=_check_clip(clip_grad_norm, where))

    @property
    def bucket_bytes(self) -> float:
        return self.bucket_mb * 2**20


def _setting(name: str, given: Any, config: Config, where: str = "prepare") -> tuple[Any, str | None]:
    """An option's value and where it was set: the explicit argument, else the environment's ``UNIDIST_*``, else
    the default (source None). An argument and a variable that disagree are a ConfigError naming both: one of
    them would otherwise be ignored without a word."""
    env_value = getattr(config, name)
    var = f"UNIDIST_{name.upper()}"
    in_env = name in config.from_environment
    if given is None:
        return env_value, (f"{var}={env_value}" if in_env else None)
    if in_env and given != env_value:
        raise ConfigError(f"{where}({name}={given!r}) and the environment's {var}={env_value!r} disagree; set one "
                          f"of them (unset {var}, or drop the argument)")
    return given, f"{where}({name}={given!r})"


@dataclass(frozen=True)
class TrainOptions:
    """What ``prepare`` was asked for, checked; backends read it, never the raw keywords."""

    zero_stage: int = 0
    clip_grad_norm: float | None = None
    op: ReduceOp = ReduceOp.MEAN
    compression: str = "none"
    backward_passes_per_step: int = 1
    bucket_mb: float = 25.0
    group: Any = None  # a Group of this Manager, or None for the whole world
    deepspeed_config: Mapping[str, Any] | str | Path | None = None
    precision: str = "32"
    loss_scaling: ScalerOptions = field(default_factory=ScalerOptions)
    reducer: str = "auto"
    sync_batchnorm: bool = False  # BatchNorm over the whole batch across the data-parallel ranks (sync_batchnorm.py)
    offload: str | None = None  # "cpu": ZeRO's shards and optimizer state in host memory (offload.py)
    fingerprint: str | None = None  # where rank 0 writes one line per optimizer step (fingerprint.py), or None
    # where each explicitly set option came from ("prepare(zero_stage=3)", "UNIDIST_ZERO_STAGE=3"); an engine
    # config that disagrees names it (engines/deepspeed/config.py)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def parse(cls, config: Config, *, zero_stage: int | None, clip_grad_norm: float | None,
              op: ReduceOp | str, compression: str | None, backward_passes_per_step: int | None,
              bucket_mb: float | None, group: Any, deepspeed_config: Mapping[str, Any] | str | Path | None,
              precision: str | None = None, loss_scaling: Mapping[str, Any] | None = None,
              reducer: str = "auto", sync_batchnorm: bool = False, offload: str | None = None,
              fingerprint: str | os.PathLike[str] | None = None, unknown: Mapping[str, Any]) -> TrainOptions:
        """``None`` takes the UNIDIST_* default; ``unknown`` are the keywords prepare did not recognise."""
        if unknown:
            hints = {"config": "deepspeed_config", "gradient_clipping": "clip_grad_norm",
                     "gradient_accumulation_steps": "backward_passes_per_step"}
            said = ", ".join(f"{k!r}" + (f" (did you mean {hints[k]}=?)" if k in hints else "") for k in unknown)
            raise InvalidArgumentError(f"prepare() got unknown keyword(s) {said}; it accepts "
                                       f"{', '.join(PREPARE_ARGS)}")
        if zero_stage is not None and (zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool)):
            raise InvalidArgumentError(f"prepare(zero_stage={zero_stage!r}); use 0, 1, 2 or 3")
        sources: dict[str, str] = {}
        stage, where = _setting("zero_stage", zero_stage, config)
        if where:
            sources["zero_stage"] = where
        mode, where = _setting("precision", Precision.of(precision).name if precision is not None else None, config)
        if where:
            sources["precision"] = where
        if clip_grad_norm is not None:
            sources["clip_grad_norm"] = f"prepare(clip_grad_norm={clip_grad_norm!r})"
        if backward_passes_per_step is not None:
            sources["backward_passes_per_step"] = f"prepare(backward_passes_per_step={backward_passes_per_step!r})"
        scaling = ScalerOptions.parse(loss_scaling)
        if loss_scaling is not None and mode != "fp16-mixed":
            raise InvalidArgumentError(f"prepare(loss_scaling=...) configures fp16's loss scaling, and this prepare "
                                       f"runs precision={mode!r}; pass it with precision='fp16-mixed'")
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise InvalidArgumentError(f"prepare(zero_stage={stage!r}); use 0, 1, 2 or 3")
        # a DeepSpeed config may still set the stage: the deepspeed backend checks again once it is known
        moved = offload_.check(offload, stage if deepspeed_config is None else None)
        if not isinstance(sync_batchnorm, bool):
            raise InvalidArgumentError(f"prepare(sync_batchnorm={sync_batchnorm!r}) takes True or False")
        if reducer not in REDUCERS:
            raise InvalidArgumentError(f"prepare(reducer={reducer!r}); use one of {', '.join(REDUCERS)}")
        if deepspeed_config is not None and not isinstance(deepspeed_config, (Mapping, str, Path)):
            raise InvalidArgumentError(f"prepare(deepspeed_config=...) takes a dict or a JSON file path, got "
                                       f"{type(deepspeed_config).__name__}")
        if fingerprint is not None and not isinstance(fingerprint, (str, os.PathLike)):
            raise InvalidArgumentError(f"prepare(fingerprint=...) takes a file path, got {type(fingerprint).__name__}")
        trace, where = _setting("fingerprint", None if fingerprint is None else os.fspath(fingerprint), config)
        if where:
            sources["fingerprint"] = where
        sync = SyncOptions.parse(
            "prepare", op=op, compression=config.compression if compression is None else compression,
            backward_passes_per_step=1 if backward_passes_per_step is None else backward_passes_per_step,
            bucket_mb=config.bucket_mb if bucket_mb is None else bucket_mb, clip_grad_norm=clip_grad_norm)
        return cls(zero_stage=stage, clip_grad_norm=sync.clip_grad_norm, op=sync.op, compression=sync.compression,
                   backward_passes_per_step=sync.backward_passes_per_step, bucket_mb=sync.bucket_mb, group=group,
                   deepspeed_config=deepspeed_config, precision=mode, loss_scaling=scaling, reducer=reducer,
                   sync_batchnorm=sync_batchnorm, offload=moved, fingerprint=trace, sources=sources)

    @property
    def sync(self) -> SyncOptions:
        """The gradient-reduction part (already checked by ``parse``)."""
        return SyncOptions(op=self.op, compression=self.compression,
                           backward_passes_per_step=self.backward_passes_per_step, bucket_mb=self.bucket_mb,
                           clip_grad_norm=self.clip_grad_norm)


PREPARE_ARGS: tuple[str, ...] = tuple(f.name for f in fields(TrainOptions) if f.name != "sources")
