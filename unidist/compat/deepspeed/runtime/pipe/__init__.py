"""``deepspeed.runtime.pipe``: the pipeline engine and module where DeepSpeed's own runtime keeps them."""

from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from unidist.compat.deepspeed.runtime.pipe import engine

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "engine"]

__getattr__ = uncovered(__name__)
