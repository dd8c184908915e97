"""TEMPORARY minimal stand-in (the lead's bootstrap); helper CONFIG's config.py replaces it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError

__all__ = ["DSConfig", "load_source", "parse"]


@dataclass(frozen=True)
class DSConfig:
    raw: Mapping[str, Any]
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 1.0
    zero_stage: int = 0
    reduce_bucket_size: int = 500_000_000
    optimizer: Mapping[str, Any] | None = None
    scheduler: Mapping[str, Any] | None = None
    fp16: Mapping[str, Any] = field(default_factory=lambda: {"enabled": False})
    bf16_enabled: bool = False
    zero_allow_untested_optimizer: bool = False
    dataloader_drop_last: bool = False
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False

    def precision(self) -> str:
        return "fp16-mixed" if self.fp16.get("enabled") else "bf16-mixed" if self.bf16_enabled else "32"

    def deepspeed_only(self) -> dict[str, Any]:
        return {}


def load_source(args: Any, config: Any, config_params: Any) -> dict[str, Any]:
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise DeepSpeedConfigError("DeepSpeed requires --deepspeed_config to specify configuration file")
    if isinstance(config, Mapping):
        return dict(config)
    with open(config) as f:
        return dict(json.load(f))


def parse(raw: Mapping[str, Any], world_size: int, *, on_deepspeed: bool) -> DSConfig:
    tb, mb = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    gas = raw.get("gradient_accumulation_steps")
    if tb and mb and not gas:
        gas = tb // mb // world_size
    elif tb and gas and not mb:
        mb = tb // world_size // gas
    elif mb and gas and not tb:
        tb = mb * gas * world_size
    elif tb and not mb and not gas:
        gas, mb = 1, tb // world_size
    elif mb and not tb and not gas:
        gas, tb = 1, mb * world_size
    zero = raw.get("zero_optimization", {})
    return DSConfig(raw=raw, train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas,
                    gradient_clipping=float(raw.get("gradient_clipping", 1.0)), zero_stage=int(zero.get("stage", 0)),
                    optimizer=raw.get("optimizer"), scheduler=raw.get("scheduler"),
                    fp16={"enabled": False, **raw.get("fp16", {})},
                    bf16_enabled=bool(raw.get("bf16", {}).get("enabled", False)),
                    zero_allow_untested_optimizer=bool(raw.get("zero_allow_untested_optimizer", False)))
