"""nccl-tests' bus bandwidth factors: busbw = algbw x factor(n), algbw = bytes / time.

``bytes`` is nccl-tests' size: the buffer of allreduce, broadcast and reduce, the whole gathered output of
allgather and gather, the whole input of reduce_scatter, scatter and alltoall. The factor turns algbw into
the rate each rank's link moves data at, comparable across collectives and rank counts (nccl-tests'
doc/PERFORMANCE.md). One table, read by the collectives benchmark and the timeline's summary.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FACTORS", "busbw_factor"]


def _ring(n: int) -> float:
    return (n - 1) / n


FACTORS: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": _ring, "reduce_scatter": _ring, "alltoall": _ring, "gather": _ring, "scatter": _ring,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 1.0,
}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for ``op`` on ``n`` ranks (1 for a call it does not list)."""
    factor = FACTORS.get(op)
    return factor(n) if factor is not None and n > 0 else 1.0
