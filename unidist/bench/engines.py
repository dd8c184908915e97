"""The engines' own calls, as their users write them: what unidist is compared against.

Each backend's record (``unidist.registry``; unidist's own in ``unidist/engines/``) carries them: a table
mapping a collective to a builder that, given the input tensor unidist is timed on, allocates what the engine
needs (output buffers, numpy views) once, outside the timing, and returns a zero-argument call moving the same
bytes as unidist's; and ``grad_mean``, the per-tensor gradient average a hand-written data-parallel loop would
do with the engine alone (the reference of ``gradsync``). A backend without them (local) gets no raw column.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from unidist import registry

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["OPS", "collective_table", "engine_name", "grad_mean"]

OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall")

Builder = Callable[[torch.Tensor], Callable[[], Any]]


def engine_name(backend: str) -> str:
    """What the tables call ``backend``'s own API (``"mpi4py"``)."""
    return registry.get(backend).raw.api


def collective_table(mgr: Manager) -> Mapping[str, Builder]:
    """The raw calls of ``mgr``'s engine by collective name; empty where the record has none."""
    raw = registry.get(mgr.backend).raw.calls
    return {} if raw is None else raw(mgr)


def grad_mean(mgr: Manager) -> Callable[[torch.Tensor], Any] | None:
    """The engine's in-place average of one gradient over the ranks (None where the record has none)."""
    raw = registry.get(mgr.backend).raw.grad_mean
    return None if raw is None else raw(mgr)
