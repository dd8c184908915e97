"""``deepspeed.zero``: the two calls scripts make around ZeRO-3's partitioned parameters.

``GatheredParameters(params)`` gives the full parameters inside the block on every backend (unidist's ZeRO-3
gathers them; on the deepspeed backend DeepSpeed's own call does); with ``modifier_rank`` that rank's edits reach
every rank, as DeepSpeed's do. ``Init`` builds the model inside it partitioned under DeepSpeed; off DeepSpeed
the model is built whole and ``initialize`` partitions it, so the peak memory while building is the whole model's
(the trained weights are the same): ``Init`` is accepted and does nothing there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from unidist.compat.deepspeed import state
from unidist.errors import InvalidArgumentError

__all__ = ["GatheredParameters", "Init"]


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> Iterator[None]:
    """Full parameters inside the block.

    Args:
        params: a parameter or an iterable of them, of a model ``initialize`` prepared (other tensors are whole).
        modifier_rank: the rank whose edits inside the block every rank keeps (None: read only; edits made
            identically on every rank are kept too).
        fwd_module: accepted (DeepSpeed registers external parameters with it).
        enabled: False makes the block do nothing.
    """
    plist = [params] if isinstance(params, torch.Tensor) else list(params if isinstance(params, Iterable) else [])
    engine = state.engine_of(plist) if enabled and plist else None
    if engine is None:
        yield
        return
    mgr = engine.manager
    if modifier_rank is not None and not 0 <= modifier_rank < mgr.size:
        raise InvalidArgumentError(f"GatheredParameters(modifier_rank={modifier_rank}): no such rank (world size "
                                   f"{mgr.size})")
    with mgr.gathered_parameters(engine.prepared_model):
        yield
        if modifier_rank is not None and mgr.size > 1:
            with torch.no_grad():
                for p in plist:
                    mgr.broadcast_(p.data, modifier_rank)


class Init(contextlib.nullcontext):  # type: ignore[type-arg]
    """``deepspeed.zero.Init(...)``: accepted with any arguments; the model is partitioned by ``initialize``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
