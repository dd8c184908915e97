"""The pipeline x data-parallel grid of a ``PipelineModule``: DeepSpeed's rank layout and its groups.

DeepSpeed's ``PipeDataParallelTopology(num_pp, num_dp)`` (runtime/pipe/topology.py) orders the axes
``['pipe', 'data']``, so global rank = stage * dp + data index: at 4 ranks with 2 stages, stage 0 is ranks 0 and
1, stage 1 ranks 2 and 3. Each rank belongs to one pipe group (the stages of its data index, in stage order: the
pipeline it runs in) and one data-parallel group (the ranks of its stage: gradients are averaged over it). Both
are unidist Groups made by ``Manager.split``, so the pipeline's send/recv and the averaging run on any engine.

A script may name the grid as Megatron-DeepSpeed does, with a topology object instead of ``num_stages``
(``PipelineModule(topology=PipeModelDataParallelTopology(num_pp, num_mp, num_dp))``): the classes here are
DeepSpeed's (``deepspeed.runtime.pipe.topology``, ranks numbered row-major over the axes), and ``stages_of`` reads
any object with ``axes``/``dims`` as pipe x data with a model axis of 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unidist.errors import InvalidArgumentError

__all__ = ["PipeDataParallelTopology", "PipeGrid", "PipeModelDataParallelTopology", "ProcessTopology", "check_stages",
           "stages_of"]


class ProcessTopology:
    """Named axes and their sizes, ranks numbered row-major (DeepSpeed's class, the parts scripts read).

    Args:
        axes: axis names, outermost first.
        dims: each axis's size.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        self.axes, self.dims = list(axes), list(dims)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis, as DeepSpeed's)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel replicas: rank = stage x num_dp + replica."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallel; the compat layer runs it with ``num_mp=1``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])


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


def stages_of(topology: object, world: int, num_stages: int | None) -> int:
    """The number of stages of a DeepSpeed topology (``axes``/``dims``: pipe, data and a model axis of 1, in
    DeepSpeed's order) covering the world, or an InvalidArgumentError saying what to pass instead."""
    axes, dims = getattr(topology, "axes", None), getattr(topology, "dims", None)
    if not isinstance(axes, list) or not isinstance(dims, list) or len(axes) != len(dims) or "pipe" not in axes:
        raise InvalidArgumentError(f"PipelineModule(topology={topology!r}) takes DeepSpeed's ProcessTopology "
                                   "(PipeDataParallelTopology(num_pp, num_dp)), or pass num_stages")
    sizes = dict(zip(axes, dims, strict=True))
    other = [a for a in axes if a not in ("pipe", "data", "model")]
    if other:
        raise InvalidArgumentError(f"PipelineModule(topology=...) has axes {other} unidist.compat.deepspeed does not "
                                   "run (pipe, data and model only); pass num_stages, or run under the deepspeed "
                                   "launcher with real deepspeed")
    if sizes.get("model", 1) != 1:
        raise InvalidArgumentError(f"PipelineModule(topology=...) with model={sizes['model']}: tensor parallelism "
                                   "inside a DeepSpeed pipeline is not supported by unidist.compat.deepspeed; use "
                                   "num_mp=1 (unidist.parallel has tensor-parallel layers of its own), or run "
                                   "under the deepspeed launcher with real deepspeed")
    if "data" in sizes and axes.index("pipe") > axes.index("data"):
        raise InvalidArgumentError(f"PipelineModule(topology=...) orders its axes {axes}: DeepSpeed's pipelines put "
                                   "'pipe' before 'data' (PipeDataParallelTopology); use that order")
    if math.prod(dims) != world:
        raise InvalidArgumentError(f"PipelineModule(topology=...) covers {math.prod(dims)} ranks ({sizes}) but the "
                                   f"world has {world}: make pipe x data = {world}")
    if num_stages is not None and num_stages != sizes["pipe"]:
        raise InvalidArgumentError(f"PipelineModule(num_stages={num_stages}, topology=...) disagree (its pipe axis "
                                   f"is {sizes['pipe']}): pass one of them")
    return check_stages(sizes["pipe"], world)


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
