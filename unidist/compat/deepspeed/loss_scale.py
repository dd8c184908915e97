"""A DeepSpeed ``fp16`` section as ``prepare(precision="fp16-mixed", loss_scaling=...)``: the same loss scale after
every step and the same skipped steps as DeepSpeed 0.19.8, off DeepSpeed.

DeepSpeed 0.19.8 has two fp16 scalers, and which one runs depends on the ZeRO stage:

- ZeRO 1-3 build ``DynamicLossScaler`` (deepspeed/runtime/fp16/loss_scaler.py:208-290 via ``CreateLossScaler``,
  zero/stage_1_and_2.py:722, zero/stage3.py:524): scale ``2**initial_scale_power``; an overflow backs off (halves,
  floored at ``min_loss_scale``) only once ``hysteresis`` overflows have used up its delay, else uses one up; an
  overflow with the scale already at the floor raises; it doubles when the good steps since the last overflow,
  minus one, are a positive multiple of ``loss_scale_window``; a growth (or with ``consecutive_hysteresis`` any
  good step) refills the hysteresis.
- Stage 0 wraps the optimizer in ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` (engine.py:2555-2609), whose own
  ``_update_scale`` (fp16/fused_optimizer.py:404-428, fp16/unfused_optimizer.py:277-301) has the same growth
  count and floor but **no hysteresis** (every overflow backs off) and no error at the floor.

Either way a step with inf/nan gradients is skipped, and ``loss_scale`` > 0 is a static scale that never moves
(overflowing steps are still skipped). ``loss_scaling`` gives unidist's ``ScalerOptions`` (train/precision.py)
for the one the given stage runs; tests/unit/test_ds_loss_scale.py drives both against DeepSpeed's own classes.

Differences: DeepSpeed's scale is a Python float and grows without bound; unidist's is GradScaler's float32
tensor, which does not grow past float32's largest power of two (2**127, reached only after 100+ growths without
an overflow). At the floor, ZeRO's bare ``Exception`` is unidist's ``LossScaleFloorError`` (a RuntimeError).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError

__all__ = ["FP16_DEFAULTS", "loss_scaling"]

# DeepSpeedFP16Config's defaults for the keys the scale reads (deepspeed/runtime/precision_config.py:115-158)
FP16_DEFAULTS: Mapping[str, Any] = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                                    "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}


def loss_scaling(fp16: Mapping[str, Any], *, zero_stage: int | None = None) -> dict[str, Any]:
    """``prepare``'s ``loss_scaling`` dict for a DeepSpeed ``fp16`` section (DeepSpeed's defaults for absent keys).

    ``zero_stage`` picks DeepSpeed's scaler: None (or 1-3) is ZeRO's ``DynamicLossScaler`` (with hysteresis and
    the error at the floor), 0 is the stage-0 fp16 optimizers' (no hysteresis). Values DeepSpeed's config would
    refuse raise ``DeepSpeedConfigError``, and so does ``hysteresis`` < 1, with which DeepSpeed never backs off.
    """
    if not isinstance(fp16, Mapping):
        raise DeepSpeedConfigError(f"fp16 must be a dict (DeepSpeed's fp16 section), got {type(fp16).__name__}")
    if zero_stage not in (None, 0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise DeepSpeedConfigError(f"loss_scaling(zero_stage={zero_stage!r}): use 0, 1, 2, 3 or None (ZeRO's scaler)")
    section = {**FP16_DEFAULTS, **{k: v for k, v in fp16.items() if k in FP16_DEFAULTS}}
    static = _number(section, "loss_scale", lowest=0.0)
    if static > 0:  # a static scale: LossScaler(scale) at ZeRO, cur_scale never moved at stage 0
        return {"init_scale": static, "dynamic": False}
    power = _integer(section, "initial_scale_power", lowest=None)
    window = _integer(section, "loss_scale_window", lowest=1)
    floor = _integer(section, "min_loss_scale", lowest=1)  # an int field, > 0 (precision_config.py:155,195)
    hysteresis = _integer(section, "hysteresis", lowest=1)
    consecutive = section["consecutive_hysteresis"]
    if not isinstance(consecutive, bool):
        raise DeepSpeedConfigError(f"fp16.consecutive_hysteresis={consecutive!r}: must be true or false")
    zero = zero_stage is None or zero_stage > 0
    return {"init_scale": float(2**power), "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": window,
            "growth_rule": "deepspeed", "min_scale": float(floor), "hysteresis": hysteresis if zero else 1,
            "consecutive_hysteresis": consecutive if zero else False, "raise_at_min_scale": zero}


def _number(section: Mapping[str, Any], key: str, lowest: float | None) -> float:
    """A finite number (no bool), as DeepSpeed's validators take it (precision_config.py:120-133, 165-179)."""
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DeepSpeedConfigError(f"fp16.{key}={value!r}: must be a finite number")
    if lowest is not None and value < lowest:
        raise DeepSpeedConfigError(f"fp16.{key}={value!r}: must be >= {lowest:g} (0 enables dynamic loss scaling)")
    return float(value)


def _integer(section: Mapping[str, Any], key: str, lowest: int | None) -> int:
    """An int (an integral float is accepted, as pydantic coerces it); ``lowest`` says what it needs."""
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise DeepSpeedConfigError(f"fp16.{key}={value!r}: must be an integer")
    if lowest is not None and value < lowest:
        why = ("with a smaller one DeepSpeed never backs off the scale" if key == "hysteresis"
               else "DeepSpeed refuses it with dynamic loss scaling (loss_scale=0)")
        raise DeepSpeedConfigError(f"fp16.{key}={value!r}: must be >= {lowest}; {why}")
    return int(value)
