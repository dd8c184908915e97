"""``deepspeed.runtime.engine``: scripts import ``DeepSpeedEngine`` from here (``isinstance`` checks)."""

from unidist.compat.deepspeed.engine import DeepSpeedEngine
from unidist.compat.deepspeed.missing import uncovered

__all__ = ["DeepSpeedEngine"]

__getattr__ = uncovered(__name__)
