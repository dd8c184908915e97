"""``deepspeed.runtime.pipe.engine``: ``PipelineEngine`` (``isinstance`` checks)."""

from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]

__getattr__ = uncovered(__name__)
