"""Model parallelism written once on unidist's collectives and send/recv: tensor-parallel linear layers and
pipeline schedules over any Manager or Group, on every backend (see tensor.py and pipeline.py)."""

from unidist.parallel.pipeline import Pipeline
from unidist.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)

__all__ = ["ColumnParallelLinear", "Pipeline", "RowParallelLinear", "copy_to_group", "gather_from_group",
           "reduce_from_group", "scatter_to_group"]
