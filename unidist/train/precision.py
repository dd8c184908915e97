"""Mixed precision with one meaning on every backend: ``prepare(..., precision=)``.

The modes are Lightning's names, because users arrive knowing them, plus DeepSpeed's bf16 (``"bf16-master"``);
each mode's dtypes are one row of unidist/precisions.py and :class:`Precision` is that row in torch's terms:

- ``"32"``: float32 everywhere (the default).
- ``"bf16-mixed"`` / ``"fp16-mixed"``: the model's forward runs under ``torch.autocast`` in bfloat16 / float16;
  parameters, gradients and optimizer state stay float32 (the parameters *are* the master weights), and the
  forward's floating outputs are returned as float32 so the loss is computed in float32.
- ``"bf16-true"``: the model itself is bfloat16 (parameters, gradients, optimizer state); floating inputs
  are cast to bfloat16 and outputs returned as float32. No master weights: the memory halves and so does the
  precision of the update.
- ``"bf16-master"``: the bfloat16 model of ``"bf16-true"`` (forward, gradients and their averaging), while the
  optimizer steps float32 master copies, made from the bfloat16-rounded weights and written back rounded after
  each step (masters.py; ZeRO's shards are the masters): DeepSpeed's ``bf16`` section.

fp16's range is narrow, so ``"fp16-mixed"`` adds dynamic loss scaling with torch ``GradScaler``'s parameters
and arithmetic (``LossScaler``): the loss is multiplied by the scale before backward, the reduced gradients
are unscaled (and checked for inf/nan) before clipping and the step, a step whose gradients are not finite
is skipped and the scale backs off, and after ``growth_interval`` good steps it grows. Optional fields give
DeepSpeed's dynamic loss scaler too (hysteresis, a floor, its growth count, a static scale), so a DeepSpeed
``fp16`` section skips the same steps with the same scales off DeepSpeed (compat/deepspeed/loss_scale.py).
The skip decision must be the same on every rank, or the replicas part ways (pytorch/pytorch#76282); the
optimizers make it from gradients every rank holds identically, or agree on it with one collective where each
rank holds a shard (ZeRO).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unidist.errors import InvalidArgumentError, UnidistError
from unidist.precisions import MODES, PRECISIONS, Mode
from unidist.request import ScalerOptions
from unidist.tree import map_tensors

__all__ = ["PRECISIONS", "LossScaleFloorError", "LossScaler", "Precision", "cast_floats", "next_scale"]


class LossScaleFloorError(UnidistError, RuntimeError):
    """An overflow that would back off a scale already at ``min_scale``, with ``raise_at_min_scale`` (DeepSpeed's
    ZeRO optimizers stop the run there: deepspeed/runtime/fp16/loss_scaler.py:261-263)."""


def next_scale(o: ScalerOptions, scale: float, tracker: int, hysteresis: int, found_inf: bool
               ) -> tuple[float, int, int]:
    """One update of the scale beyond GradScaler's: ``(scale, tracker, hysteresis left)`` after a step.

    DeepSpeed's rule (loss_scaler.py:255-290): an overflow backs off only when hysteresis is 1 (the option or
    what is left), else uses one up; either way it restarts the growth count. A good step refills hysteresis
    with ``consecutive_hysteresis``, and grows when the count reaches ``growth_interval`` (refilling hysteresis
    too). The arithmetic is float64 as DeepSpeed's (exact for its powers of two); a growth that would leave
    float32's range is not taken, as GradScaler's kernel does not."""
    if not o.dynamic:
        return scale, tracker, hysteresis
    f32 = _f32(scale)
    if found_inf:
        if o.hysteresis == 1 or hysteresis <= 1:
            if o.raise_at_min_scale and f32 == _f32(o.min_scale):
                raise LossScaleFloorError(f"fp16 overflow with the loss scale already at min_scale={o.min_scale}: "
                                          "it cannot back off further (DeepSpeed stops the run here too); lower "
                                          "min_loss_scale or find what makes the gradients inf/nan")
            scale = max(scale * o.backoff_factor, o.min_scale)
        else:
            hysteresis -= 1
        return _f32(scale), o.start_tracker, hysteresis
    if o.consecutive_hysteresis:
        hysteresis = o.hysteresis
    tracker += 1
    if tracker >= o.growth_interval:
        grown = _f32(scale * o.growth_factor)
        if math.isfinite(grown):
            scale = grown
        tracker = 0
        hysteresis = o.hysteresis
    return _f32(scale), tracker, hysteresis


def _f32(x: float) -> float:
    """``x`` as the float32 scale tensor holds it (inf beyond float32's range)."""
    return array("f", [x])[0]


class LossScaler:
    """GradScaler's dynamic loss scale, driven by the optimizer that knows when all ranks agree.

    The scale is a float32 tensor updated with torch's own ``_amp_update_scale_`` and gradients are unscaled with
    ``_amp_foreach_non_finite_check_and_unscale_``, so the scale sequence and the unscaled gradients are GradScaler's
    bit for bit. Its ``state_dict`` has GradScaler's keys, so either can load the other's. With DeepSpeed's
    options (``ScalerOptions``) the scale moves by ``next_scale`` instead.
    """

    def __init__(self, options: ScalerOptions, device: torch.device) -> None:
        self.options = options
        self._scale = torch.full((), options.init_scale, dtype=torch.float32, device=device)
        self._tracker = torch.full((), options.start_tracker, dtype=torch.int32, device=device)
        self.hysteresis = options.hysteresis  # overflows left before a back-off
        self.skipped_steps = 0
        self.last_step_skipped = False

    @property
    def scale_value(self) -> float:
        """The current loss scale (the name DeepSpeed's ``AgreedGradScaler`` reports it under too)."""
        return float(self._scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale (as ``GradScaler.scale``)."""
        return loss * self._scale.to(device=loss.device, non_blocking=True)

    def unscale(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; returns a float32 flag tensor: 1.0 if any was inf or nan."""
        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device)
        inv = self._scale.double().reciprocal().float().reshape(1)  # GradScaler computes it this way
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            here = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, here, inv.to(device))
            found += here.to(found.device)
        return found.clamp_(max=1.0)

    def update(self, found_inf: torch.Tensor) -> None:
        """After a step (applied or skipped): back off on inf, grow after ``growth_interval`` good steps."""
        o = self.options
        self.last_step_skipped = bool(found_inf)
        self.skipped_steps += self.last_step_skipped
        if o.gradscaler:
            torch._amp_update_scale_(self._scale, self._tracker, found_inf.to(self._scale.device).reshape(()),
                                     o.growth_factor, o.backoff_factor, o.growth_interval)
            return
        scale, tracker, self.hysteresis = next_scale(o, self.scale_value, int(self._tracker), self.hysteresis,
                                                     self.last_step_skipped)
        self._scale.fill_(scale)
        self._tracker.fill_(tracker)

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys (and the skipped-step count, and the hysteresis left)."""
        return {"scale": self.scale_value, "growth_factor": self.options.growth_factor,
                "backoff_factor": self.options.backoff_factor, "growth_interval": self.options.growth_interval,
                "_growth_tracker": int(self._tracker), "skipped_steps": self.skipped_steps,
                "hysteresis": self.hysteresis}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume a scale (the factors and interval stay those this run was prepared with)."""
        self._scale.fill_(float(state["scale"]))
        self._tracker.fill_(int(state.get("_growth_tracker", self.options.start_tracker)))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.hysteresis = int(state.get("hysteresis", self.options.hysteresis))


@dataclass(frozen=True)
class Precision:
    """One precision mode (its row of unidist/precisions.py) in torch's terms: what the forward, the parameters,
    the gradients' reduction, the optimizer and the loss get."""

    name: str = "32"

    @classmethod
    def of(cls, name: object, where: str = "prepare") -> Precision:
        if not isinstance(name, str) or name not in MODES:
            raise InvalidArgumentError(f"{where}(precision={name!r}); use one of {', '.join(map(repr, PRECISIONS))} "
                                       "(or set UNIDIST_PRECISION)")
        return cls(name)

    @property
    def mode(self) -> Mode:
        return MODES[self.name]

    @property
    def params(self) -> torch.dtype:
        """The dtype of the module's parameters during training (and of their gradients)."""
        return _dtype(self.mode.params)

    @property
    def reduce(self) -> torch.dtype:
        """The dtype gradients are averaged in."""
        return _dtype(self.mode.reduce)

    @property
    def master(self) -> torch.dtype:
        """The dtype the optimizer steps and keeps its state in (``params`` unless the mode keeps master copies)."""
        return _dtype(self.mode.master)

    @property
    def keeps_masters(self) -> bool:
        return self.mode.keeps_masters

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _dtype(self.mode.compute) if self.mode.autocast else None

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype the model's parameters are converted to, or None to keep them (float32)."""
        return None if self.mode.params == "float32" else self.params

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (fp16)."""
        return self.mode.scaled

    @property
    def mixed(self) -> bool:
        return self.mode.autocast

    def apply(self, module: torch.nn.Module, device: torch.device) -> list[Any]:
        """Make ``module``'s forward follow this mode; returns the hook handles (none for ``"32"``).

        Hooks on the module rather than a replaced ``forward``: ``copy.deepcopy`` of the model (an EMA copy)
        then carries its own, and an exception inside the forward still leaves autocast (``always_call``)."""
        if self.name == "32":
            return []
        if self.param_dtype is not None:
            module.to(self.param_dtype)
        device_type = device.type
        autocast_dtype = self.autocast_dtype
        param_dtype = self.param_dtype
        active: list[Any] = []

        def pre(mod: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            if autocast_dtype is not None:
                ctx = torch.autocast(device_type, dtype=autocast_dtype)
                ctx.__enter__()  # type: ignore[no-untyped-call]
                active.append(ctx)
            if param_dtype is not None:
                args, kwargs = cast_floats(args, param_dtype), cast_floats(kwargs, param_dtype)
            return args, kwargs

        def post(mod: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
            if active:
                active.pop().__exit__(None, None, None)
            return cast_floats(out, torch.float32)

        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, with_kwargs=True, always_call=True)]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unidist/precisions.py names {name!r}, which is not a torch dtype")
    return dtype


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in ``data`` as ``dtype``, each container keeping its type (``ModelOutput``,
    namedtuples, dataclasses, nested lists and dicts: unidist/tree.py); the rest unchanged. (Also DeepSpeed's
    output cast, engines/deepspeed/trainer.py.)"""
    return map_tensors(data, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
