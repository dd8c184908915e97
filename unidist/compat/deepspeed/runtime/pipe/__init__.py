"""``deepspeed.runtime.pipe``: the pipeline engine and module where DeepSpeed's own runtime keeps them."""

from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from unidist.compat.deepspeed.runtime.pipe import engine, topology
from unidist.compat.deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec", "engine", "topology"]

__getattr__ = uncovered(__name__)
