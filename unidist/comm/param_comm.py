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

__all__ = ["ReduceComm", "reduce_comm_of", "set_reduce_comm", "split_by_comm"]

K = TypeVar("K")

_ATTR = "_unidist_reduce_comm"


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
