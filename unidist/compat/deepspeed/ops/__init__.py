"""``deepspeed.ops``: ``adam`` (FusedAdam, DeepSpeedCPUAdam on torch's Adam) on every backend; DeepSpeed's other
kernels (sparse attention, op builders, Lamb, Lion ...) are DeepSpeed's own."""

from __future__ import annotations

from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.ops import adam

__all__ = ["adam"]

__getattr__ = uncovered(__name__)
