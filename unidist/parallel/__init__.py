"""Model parallelism written once on unidist's collectives and send/recv: tensor-parallel linear layers, pipeline
schedules and Mixture-of-Experts layers over any Manager or Group, on every backend (see tensor.py, pipeline.py and
moe.py)."""

from unidist.parallel.moe import MoE
from unidist.parallel.pipeline import Pipeline
from unidist.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)

__all__ = ["ColumnParallelLinear", "MoE", "Pipeline", "RowParallelLinear", "copy_to_group", "gather_from_group",
           "reduce_from_group", "scatter_to_group"]
