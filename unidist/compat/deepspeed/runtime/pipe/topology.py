"""``deepspeed.runtime.pipe.topology``: the topology objects Megatron-DeepSpeed hands ``PipelineModule(topology=)``
(defined with the pipe grid they describe: ``unidist.compat.deepspeed.pipe.topology``)."""

from unidist.compat.deepspeed.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
