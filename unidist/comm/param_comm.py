"""Which communicator a parameter's gradient is averaged over when it is not the data-parallel one.

A Mixture-of-Experts layer (``unidist.parallel.moe``) holds different experts on different ranks: an expert's
gradient must be summed over the ranks holding the same expert (its expert-data-parallel group) and divided by the
whole data-parallel size (every rank's tokens reached it), as DeepSpeed reduces expert gradients. The layer marks
its parameters here; ``prepare`` (the training layer, which may not import the layer) reads the mark. One small
module both sides import, instead of an attribute each would spell.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

from unidist.comm.protocol import Comm

__all__ = ["ExpertSlot", "ReduceComm", "expert_slot_of", "reduce_comm_of", "set_expert_slot", "set_reduce_comm",
           "split_by_comm"]

K = TypeVar("K")

_ATTR = "_unidist_reduce_comm"
_SLOT = "_unidist_expert_slot"


@dataclass(frozen=True)
class ReduceComm:
    """Sum the gradient over ``comm``, then divide it by ``divide_by``."""

    comm: Comm
    divide_by: int


def set_reduce_comm(param: torch.Tensor, comm: Comm, divide_by: int) -> None:
    """Mark ``param``: its gradient is summed over ``comm`` and divided by ``divide_by``."""
    setattr(param, _ATTR, ReduceComm(comm, divide_by))


def reduce_comm_of(param: torch.Tensor) -> ReduceComm | None:
    """The mark ``set_reduce_comm`` left on ``param``, or None (the data-parallel average)."""
    found = getattr(param, _ATTR, None)
    return found if isinstance(found, ReduceComm) else None


def split_by_comm(items: Iterable[tuple[K, torch.Tensor]]) -> tuple[list[K], list[tuple[ReduceComm, list[K]]]]:
    """The keys of unmarked tensors (the data-parallel ones), and the marked ones grouped by their communicator,
    in first-seen order (every rank builds the same groups from the same model)."""
    plain: list[K] = []
    marked: dict[int, tuple[ReduceComm, list[K]]] = {}
    for key, t in items:
        mark = reduce_comm_of(t)
        if mark is None:
            plain.append(key)
        else:
            marked.setdefault(id(mark.comm), (mark, []))[1].append(key)
    return plain, list(marked.values())


@dataclass(frozen=True)
class ExpertSlot:
    """Which expert of its layer a parameter belongs to: local expert ``local`` of ``per_rank`` under the module
    list named ``key``, on the rank at ``place`` of an expert-parallel group of ``ep_size`` (the layer's expert
    ``place * per_rank + local``). A checkpoint names it by that global index, so it loads where the experts are
    spread over another number of ranks."""

    key: str
    local: int
    place: int
    ep_size: int
    per_rank: int

    def global_name(self, name: str, place: int | None = None) -> str:
        """``name`` (this rank's state-dict key) with the local index replaced by the global one of ``place``
        (default this rank's)."""
        here = f"{self.key}.{self.local}."
        at = name.rfind(here)
        if at < 0:
            raise ValueError(f"{name!r} is not under {self.key}.{self.local}")
        g = (self.place if place is None else place) * self.per_rank + self.local
        return f"{name[:at]}{self.key}.{g}.{name[at + len(here):]}"


def set_expert_slot(param: torch.Tensor, slot: ExpertSlot) -> None:
    """Mark ``param`` as part of the expert ``slot`` says."""
    setattr(param, _SLOT, slot)


def expert_slot_of(param: torch.Tensor) -> ExpertSlot | None:
    """The mark ``set_expert_slot`` left on ``param``, or None (not an expert's)."""
    found = getattr(param, _SLOT, None)
    return found if isinstance(found, ExpertSlot) else None
