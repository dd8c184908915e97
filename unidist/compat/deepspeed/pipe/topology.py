"""The pipeline x data-parallel grid of a ``PipelineModule``: DeepSpeed's rank layout and its groups.

DeepSpeed's ``PipeDataParallelTopology(num_pp, num_dp)`` (runtime/pipe/topology.py) orders the axes
``['pipe', 'data']``, so global rank = stage * dp + data index: at 4 ranks with 2 stages, stage 0 is ranks 0 and
1, stage 1 ranks 2 and 3. Each rank belongs to one pipe group (the stages of its data index, in stage order: the
pipeline it runs in) and one data-parallel group (the ranks of its stage: gradients are averaged over it). Both
are unidist Groups made by ``Manager.split``, so the pipeline's send/recv and the averaging run on any engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unidist.errors import InvalidArgumentError

__all__ = ["PipeGrid", "check_stages"]


def check_stages(num_stages: object, world: int) -> int:
    """``num_stages`` as an int that divides the world, or an InvalidArgumentError saying how to fix it."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InvalidArgumentError(f"PipelineModule(num_stages={num_stages!r}) takes a positive int: the number of "
                                   "pipeline stages")
    if world % num_stages:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise InvalidArgumentError(f"PipelineModule(num_stages={num_stages}) must divide the world size {world} "
                                   f"(each stage gets world/num_stages data-parallel ranks); use one of "
                                   f"{', '.join(map(str, fits))}, or launch a multiple of {num_stages} ranks")
    return num_stages


@dataclass
class PipeGrid:
    """This rank's place: ``stage_id`` of ``num_stages``, data index ``dp_id`` of ``dp``, and its two groups."""

    num_stages: int
    dp: int
    stage_id: int
    dp_id: int
    pipe_group: Any
    dp_group: Any

    @classmethod
    def make(cls, mgr: Any, num_stages: int) -> PipeGrid:
        """Every rank calls it (it makes groups); ``num_stages`` divides the world (``check_stages``)."""
        dp = mgr.size // num_stages
        stage, data = divmod(mgr.rank, dp)
        pipe_group = mgr.split(data, key=stage)
        dp_group = mgr.split(stage, key=data)
        return cls(num_stages, dp, stage, data, pipe_group, dp_group)

    def global_rank(self, stage: int, data: int) -> int:
        """DeepSpeed's ``stage_to_global``: the rank running ``stage`` for data index ``data``."""
        return stage * self.dp + data
