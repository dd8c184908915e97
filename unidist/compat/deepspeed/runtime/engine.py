"""``deepspeed.runtime.engine``: scripts import ``DeepSpeedEngine`` from here (``isinstance`` checks)."""

from unidist.compat.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
