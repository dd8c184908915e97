"""What ``Manager.prepare`` is asked for: one frozen object, built and validated once, before anything changes.

One signature on every backend is what lets a script move between launchers: every keyword means the same
everywhere, an unknown one is an error naming ``prepare``, the accepted names and the nearest one, and an option only
one engine understands carries that engine's name (``deepspeed_config``). ``Manager.prepare`` builds a
:class:`PrepareRequest` (``PrepareRequest.build``) and hands it to its training strategy; every trainer reads the
request, never keywords. :class:`SyncOptions` (how gradients are reduced) is the part ``distributed_optimizer`` takes
too, and the request *is* one (a subclass), so each of its fields is written once.

The base layer: plain Python, no torch (the request is made before the training layer is loaded).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unidist.config import COMPRESSIONS
from unidist.errors import ConfigError, InvalidArgumentError
from unidist.ops import ReduceOp, resolve_op
from unidist.precisions import MODES, PRECISIONS

if TYPE_CHECKING:
    import torch

    from unidist.config import Config

__all__ = ["GROWTH_RULES", "OFFLOADS", "REDUCERS", "PrepareRequest", "ScalerOptions", "SyncOptions", "check_offload"]

# prepare(reducer=...): who averages the gradients on an engine with a reducer of its own (DeepSpeed, Horovod)
REDUCERS = ("auto", "engine", "unidist")
OFFLOADS = ("none", "cpu")  # prepare(offload=...): None is "none"
GROWTH_RULES = ("torch", "deepspeed")  # ScalerOptions.growth_rule
# keywords of other libraries users bring to prepare, and the name prepare has for each
ALIASES = {"config": "deepspeed_config", "gradient_clipping": "clip_grad_norm", "clip_grad": "clip_grad_norm",
           "max_grad_norm": "clip_grad_norm", "gradient_accumulation_steps": "backward_passes_per_step",
           "stage": "zero_stage", "mixed_precision": "precision", "dtype": "precision"}


# ---------------------------------------------------------------------------------------------- fp16's loss scaling
@dataclass(frozen=True)
class ScalerOptions:
    """Dynamic loss scaling, with ``torch.amp.GradScaler``'s parameters and defaults.

    The fields after ``growth_interval`` express DeepSpeed's scalers (deepspeed/runtime/fp16/loss_scaler.py
    ``DynamicLossScaler``); at their defaults the scale is GradScaler's bit for bit:

    - ``dynamic``: False is a static scale (DeepSpeed's ``fp16.loss_scale`` > 0): it never moves, and a step with
      inf/nan gradients is still skipped.
    - ``hysteresis``: overflows it takes to back off (DeepSpeed's ``hysteresis``, ``delayed_shift``): each overflow
      before that is a skipped step that only uses one up. Once used up, every overflow backs off until a growth
      (or, with ``consecutive_hysteresis``, any good step) refills it.
    - ``min_scale``: the back-off's floor (DeepSpeed's ``min_loss_scale``); 0 is none.
    - ``growth_rule``: ``"torch"`` grows after ``growth_interval`` good steps in a row (GradScaler's count);
      ``"deepspeed"`` grows when the good steps since the last overflow (or the start), minus one, are a positive
      multiple of ``growth_interval``: the first growth after ``growth_interval + 1`` good steps, then every
      ``growth_interval`` (loss_scaler.py:282-286 ``stable_interval``).
    - ``raise_at_min_scale``: an overflow that would back off a scale already at ``min_scale`` raises
      ``LossScaleFloorError`` (DeepSpeed's ZeRO optimizers raise there; its stage-0 fp16 optimizers do not).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    dynamic: bool = True
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float = 0.0
    growth_rule: str = "torch"
    raise_at_min_scale: bool = False

    @property
    def gradscaler(self) -> bool:
        """Whether this is plain GradScaler (then torch's own update kernel moves the scale)."""
        return (self.dynamic and self.hysteresis == 1 and self.min_scale == 0.0 and self.growth_rule == "torch"
                and not self.raise_at_min_scale)

    @property
    def start_tracker(self) -> int:
        """The growth tracker at the start and after an overflow: -1 under DeepSpeed's rule, whose first growth
        after an overflow takes one good step more."""
        return -1 if self.growth_rule == "deepspeed" else 0

    @classmethod
    def parse(cls, given: Mapping[str, Any] | None, where: str = "prepare") -> ScalerOptions:
        """``prepare(loss_scaling={...})``: GradScaler's keyword names (and the DeepSpeed ones above); anything
        else is an error."""
        if given is None:
            return cls()
        if not isinstance(given, Mapping):
            raise InvalidArgumentError(f"{where}(loss_scaling=...) takes a dict of GradScaler's parameters "
                                       f"({', '.join(f.name for f in fields(cls))}), got {type(given).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise InvalidArgumentError(f"{where}(loss_scaling=...) got unknown key(s) {unknown}; it accepts "
                                       f"{', '.join(sorted(names))} (torch.amp.GradScaler's parameters, and "
                                       "DeepSpeed's scaler's)")
        opts = cls(**given)
        checks = {"init_scale": opts.init_scale > 0, "growth_factor": opts.growth_factor > 1,
                  "backoff_factor": 0 < opts.backoff_factor < 1,
                  "growth_interval": isinstance(opts.growth_interval, int) and opts.growth_interval >= 1}
        for name, ok in checks.items():
            value = getattr(opts, name)
            if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise InvalidArgumentError(f"{where}(loss_scaling={{{name!r}: {value!r}}}): need init_scale > 0, "
                                           "growth_factor > 1, 0 < backoff_factor < 1 and an int growth_interval "
                                           ">= 1")
        _check_deepspeed_fields(opts, where)
        return opts


def _check_deepspeed_fields(opts: ScalerOptions, where: str) -> None:
    """The fields beyond GradScaler's, each with what it needs."""
    h, floor = opts.hysteresis, opts.min_scale
    needs = {
        "dynamic": (isinstance(opts.dynamic, bool), "True or False (False: a static scale)"),
        "hysteresis": (isinstance(h, int) and not isinstance(h, bool) and h >= 1,
                       "an int >= 1 (the overflows it takes to back off; 1 backs off on every overflow)"),
        "consecutive_hysteresis": (isinstance(opts.consecutive_hysteresis, bool), "True or False"),
        "min_scale": (isinstance(floor, (int, float)) and not isinstance(floor, bool) and math.isfinite(floor)
                      and floor >= 0, "a finite number >= 0 (the back-off's floor; 0 is none)"),
        "growth_rule": (opts.growth_rule in GROWTH_RULES, f"one of {', '.join(map(repr, GROWTH_RULES))}"),
        "raise_at_min_scale": (isinstance(opts.raise_at_min_scale, bool), "True or False"),
    }
    for name, (ok, need) in needs.items():
        if not ok:
            raise InvalidArgumentError(f"{where}(loss_scaling={{{name!r}: {getattr(opts, name)!r}}}): "
                                       f"{name} must be {need}")


# ---------------------------------------------------------------------------------------------- each keyword's check
def _op(op: object, where: str) -> ReduceOp:
    """Gradients are averaged or summed; min/max/product make no sense for them."""
    try:
        rop = resolve_op(op)  # type: ignore[arg-type]
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{where}(op={op!r}): {err}") from None
    if rop not in (ReduceOp.MEAN, ReduceOp.SUM):
        raise InvalidArgumentError(f"{where}(op={rop.value!r}): gradients are combined with 'mean' or 'sum'")
    return rop


def _compression(compression: object, where: str) -> str:
    if compression not in COMPRESSIONS:
        raise InvalidArgumentError(f"{where}(compression={compression!r}); use one of {', '.join(COMPRESSIONS)}")
    return str(compression)


def _passes(k: object, where: str) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidArgumentError(f"{where}(backward_passes_per_step={k!r}) must be an int >= 1")
    return k


def _bucket_mb(mb: object, where: str) -> float:
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not (mb > 0 and math.isfinite(mb)):
        raise InvalidArgumentError(f"{where}(bucket_mb={mb!r}) must be a positive number of MiB")
    return float(mb)


def _clip(clip: object, where: str) -> float | None:
    if clip is None:
        return None
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (clip > 0 and math.isfinite(clip)):
        raise InvalidArgumentError(f"{where}(clip_grad_norm={clip!r}) must be a positive finite number, or None "
                                   "for no clipping")
    return float(clip)


def _stage(stage: object, where: str) -> int:
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise InvalidArgumentError(f"{where}(zero_stage={stage!r}); use 0, 1, 2 or 3")
    return int(stage)  # type: ignore[call-overload]


def _precision(name: object, where: str) -> str:
    if not isinstance(name, str) or name not in PRECISIONS:
        raise InvalidArgumentError(f"{where}(precision={name!r}); use one of {', '.join(map(repr, PRECISIONS))} "
                                   "(or set UNIDIST_PRECISION)")
    return name


def check_offload(offload: object, stage: int | None) -> str | None:
    """``prepare(offload=...)`` checked: None or ``"cpu"``; the host keeps ZeRO's shards, so it needs a stage
    (``stage`` None: not known yet, as where a DeepSpeed config may still set it)."""
    if offload is None or offload == "none":
        return None
    if offload not in OFFLOADS:
        raise InvalidArgumentError(f"prepare(offload={offload!r}); use 'cpu' (optimizer state, and at stage 3 the "
                                   "parameter shards, in host memory) or None")
    if stage == 0:
        raise InvalidArgumentError("prepare(offload='cpu') moves ZeRO's shards to host memory and zero_stage is 0 "
                                   "(every rank holds the whole optimizer); pass zero_stage=1, 2 or 3 with it (the "
                                   "same training, as DeepSpeed's offload_optimizer needs a ZeRO stage)")
    return "cpu"


# ---------------------------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class SyncOptions:
    """How gradients are reduced, checked once (``parse``); the optimizers trust what they are given.

    Attributes:
        op: ``"mean"`` (default) or ``"sum"`` of the ranks' gradients (DeepSpeed only averages).
        compression: ``"none"``, ``"fp16"`` or ``"bf16"``: the wire dtype of gradients (default
            ``UNIDIST_COMPRESSION``).
        backward_passes_per_step: k (default 1, or a DeepSpeed config's gradient_accumulation_steps):
            ``step()``/``zero_grad()`` act on every k-th call and ``backward`` divides the loss by k, so k passes
            make one k-times larger batch.
        bucket_mb: the gradient fusion buckets' size in MiB (default ``UNIDIST_BUCKET_MB``).
        clip_grad_norm: clip the averaged gradient to this global L2 norm, as ``torch.nn.utils.clip_grad_norm_``
            on one process would; None (default) never clips, on every backend (DeepSpeed's own default of 1.0 is
            switched off).
        clip_norm_group: a Group holding the model's other parts (a pipeline's other stages): the clipping's
            global norm sums their squared norms too, as DeepSpeed's PipelineEngine sums over its pipe group.
            Default None: the norm of what the data-parallel ranks hold.
        clip_norm_replicas: parameters another rank of ``clip_norm_group`` also holds and counts (a tied weight's
            later copies): left out of this rank's share of the norm, so each counts once, as DeepSpeed's ZeRO
            leaves out a pipeline's replicated parameters.
    """

    op: ReduceOp = ReduceOp.MEAN
    compression: str = "none"
    backward_passes_per_step: int = 1
    bucket_mb: float = 25.0
    clip_grad_norm: float | None = None
    clip_norm_group: object = None
    clip_norm_replicas: tuple[torch.nn.Parameter, ...] = field(default=(), compare=False)

    @classmethod
    def parse(cls, where: str, *, op: ReduceOp | str, compression: str, backward_passes_per_step: int,
              bucket_mb: float, clip_grad_norm: float | None) -> SyncOptions:
        """The one check of these fields for ``distributed_optimizer``; ``where`` names the call in errors."""
        return cls(op=_op(op, where), compression=_compression(compression, where),
                   backward_passes_per_step=_passes(backward_passes_per_step, where),
                   bucket_mb=_bucket_mb(bucket_mb, where), clip_grad_norm=_clip(clip_grad_norm, where))

    @property
    def bucket_bytes(self) -> float:
        return self.bucket_mb * 2**20


def _from_env(name: str, given: Any, config: Config, where: str) -> tuple[Any, str | None]:
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
class PrepareRequest(SyncOptions):
    """What ``Manager.prepare`` was asked for, checked; every trainer reads it, never the raw keywords. The
    gradient reduction's fields are :class:`SyncOptions`' (this is one).

    Attributes:
        zero_stage: 0-3 (default ``UNIDIST_ZERO_STAGE``): 1 shards optimizer state, 2 also gradients, 3 also
            parameters; DeepSpeed's own ZeRO on the deepspeed backend, unidist's elsewhere.
        group: data parallel over this Group of the Manager only (parameters from its rank 0, gradients averaged
            within it); None is the whole world.
        deepspeed_config: a DeepSpeed config (dict or JSON path) merged over the generated one; the deepspeed
            backend only. A setting it shares with another field (stage, clipping, precision, accumulation) must
            agree with it.
        precision: ``"32"`` (default ``UNIDIST_PRECISION``), ``"bf16-mixed"`` or ``"fp16-mixed"`` (autocast forward,
            float32 parameters and optimizer state; fp16 adds dynamic loss scaling: a step with inf/nan gradients is
            skipped on every rank), ``"bf16-true"`` (a bfloat16 model) or ``"bf16-master"`` (a bfloat16 model whose
            optimizer steps float32 master copies: DeepSpeed's ``bf16``). Outputs come back as float32. Each mode's
            dtypes: unidist/precisions.py.
        loss_scaling: fp16's dynamic loss scaling (:class:`ScalerOptions`: torch.amp.GradScaler's parameters and
            defaults, and DeepSpeed's); given as a dict.
        reducer: who averages the gradients where the engine has a reducer of its own: ``"engine"`` (DeepSpeed's
            engine, ``hvd.DistributedOptimizer``), ``"unidist"`` (unidist's fusion buckets over the engine's
            collectives) or ``"auto"`` (default: unidist's where it was measured faster and keeps the engine's math).
        sync_batchnorm: BatchNorm over the whole batch across the data-parallel ranks, on every backend (default
            False: each rank's own rows, as DDP without ``convert_sync_batchnorm``).
        offload: ``"cpu"``: ZeRO's shards, their gradients and the optimizer state in pinned host memory, stepped
            there (needs ``zero_stage`` 1-3; a no-op, said once, where the device is the CPU). Default None.
        fingerprint: a file where rank 0 writes one JSON line per optimizer step (``unidist.train.fingerprint``;
            ``unidist verify`` compares them between launches). Default None (``UNIDIST_FINGERPRINT``).
        sources: where each explicitly set field came from (``"prepare(zero_stage=3)"``, ``"UNIDIST_ZERO_STAGE=3"``);
            an engine config that disagrees names it.
    """

    zero_stage: int = 0
    group: object = None
    deepspeed_config: Mapping[str, Any] | str | Path | None = None
    precision: str = "32"
    loss_scaling: ScalerOptions = field(default_factory=ScalerOptions)
    reducer: str = "auto"
    sync_batchnorm: bool = False
    offload: str | None = None
    fingerprint: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The keywords ``prepare`` accepts: every field but ``sources``."""
        return tuple(f.name for f in fields(cls) if f.name != "sources")

    @classmethod
    def build(cls, config: Config, given: Mapping[str, Any], where: str = "prepare") -> PrepareRequest:
        """Check every keyword (``given``: what the caller passed; None stands for "not given": the environment's
        ``UNIDIST_*`` or the default) and make the request; nothing has changed yet when this raises.

        Args:
            config: the Manager's settings (``UNIDIST_*``), the defaults of ``zero_stage``, ``precision``,
                ``compression``, ``bucket_mb`` and ``fingerprint``.
            given: keyword -> value, unknown keywords included (each refused, with the nearest accepted name).
            where: the call named in error messages.
        """
        accepted = cls.names()
        unknown = [k for k in given if k not in accepted]
        if unknown:
            said = ", ".join(f"{k!r}" + (f" (did you mean {m}=?)" if (m := _nearest(k, accepted)) else "")
                             for k in unknown)
            raise InvalidArgumentError(f"{where}() got unknown keyword(s) {said}; it accepts {', '.join(accepted)}")
        g = given.get
        sources: dict[str, str] = {}
        stage = g("zero_stage")
        if stage is not None:
            _stage(stage, where)
        stage, src = _from_env("zero_stage", stage, config, where)
        mode = g("precision")
        mode, src_mode = _from_env("precision", None if mode is None else _precision(mode, where), config, where)
        trace = g("fingerprint")
        if trace is not None and not isinstance(trace, (str, os.PathLike)):
            raise InvalidArgumentError(f"{where}(fingerprint=...) takes a file path, got {type(trace).__name__}")
        trace, src_trace = _from_env("fingerprint", None if trace is None else os.fspath(trace), config, where)
        for name, value in (("zero_stage", src), ("precision", src_mode), ("fingerprint", src_trace)):
            if value:
                sources[name] = value
        for name in ("clip_grad_norm", "backward_passes_per_step"):
            if g(name) is not None:
                sources[name] = f"{where}({name}={given[name]!r})"
        scaling = ScalerOptions.parse(g("loss_scaling"), where)
        if g("loss_scaling") is not None and not MODES[mode].scaled:
            scaled = " or ".join(repr(m.name) for m in MODES.values() if m.scaled)
            raise InvalidArgumentError(f"{where}(loss_scaling=...) configures fp16's loss scaling, and this prepare "
                                       f"runs precision={mode!r}, which scales no loss; pass it with "
                                       f"precision={scaled}")
        ds_config = g("deepspeed_config")
        # a DeepSpeed config may still set the stage: the deepspeed backend checks again once it is known
        moved = check_offload(g("offload"), stage if ds_config is None else None)
        sync_bn = g("sync_batchnorm", False)
        if not isinstance(sync_bn, bool):
            raise InvalidArgumentError(f"{where}(sync_batchnorm={sync_bn!r}) takes True or False")
        reducer = g("reducer", "auto")
        if reducer not in REDUCERS:
            raise InvalidArgumentError(f"{where}(reducer={reducer!r}); use one of {', '.join(REDUCERS)}")
        if ds_config is not None and not isinstance(ds_config, (Mapping, str, Path)):
            raise InvalidArgumentError(f"{where}(deepspeed_config=...) takes a dict or a JSON file path, got "
                                       f"{type(ds_config).__name__}")
        compression = g("compression")
        bucket_mb, passes = g("bucket_mb"), g("backward_passes_per_step")
        return PrepareRequest(op=_op(g("op", ReduceOp.MEAN), where),
                   compression=_compression(config.compression if compression is None else compression, where),
                   backward_passes_per_step=_passes(1 if passes is None else passes, where),
                   bucket_mb=_bucket_mb(config.bucket_mb if bucket_mb is None else bucket_mb, where),
                   clip_grad_norm=_clip(g("clip_grad_norm"), where), zero_stage=stage,
                   clip_norm_group=g("clip_norm_group"), clip_norm_replicas=tuple(g("clip_norm_replicas") or ()),
                   group=g("group"), deepspeed_config=ds_config, precision=mode, loss_scaling=scaling,
                   reducer=reducer, sync_batchnorm=sync_bn, offload=moved, fingerprint=trace, sources=sources)


def _nearest(name: str, accepted: tuple[str, ...]) -> str | None:
    """The accepted keyword a mistaken one most likely meant: another library's name for it, or the closest."""
    if name in ALIASES:
        return ALIASES[name]
    found = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
    return found[0] if found else None
