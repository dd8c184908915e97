"""TEMPORARY minimal stand-in (the lead's bootstrap); helper SCALER's loss_scale.py replaces it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["loss_scaling"]


def loss_scaling(fp16: Mapping[str, Any]) -> dict[str, Any]:
    return {"init_scale": 2.0 ** fp16.get("initial_scale_power", 16)}
