"""Timing helpers shared by the benchmarks: calibration, interleaved rounds, medians, the slowest rank.

Why interleaved rounds: on a shared machine the load changes over seconds, so timing column A for a while and
then column B compares two different machines. Each round runs every column once (barrier, then ``iters``
calls), and the rounds repeat; the median over rounds of each column is reported, so noise hits every column
alike and one disturbed round does not move the result.

Why calibrate on one rank: the number of calls per round must be the same on every rank (each call is a
collective), so rank 0's estimate is broadcast. Why the slowest rank: a collective is done when its last
rank is, so the reported time is the maximum over ranks of each rank's median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["calibrate", "interleaved", "per_unit_rounds", "slowest", "spread"]


def calibrate(mgr: Manager, fns: Sequence[Callable[[], Any]], *, budget: float, warmup: int = 3,
              min_iters: int = 1, max_iters: int = 10000) -> int:
    """Run each fn ``warmup`` times (first calls allocate, connect and fill caches), then return how many
    calls of the slowest fn fit in ``budget`` seconds, clamped to [min_iters, max_iters]: rank 0's figure,
    the same on every rank. Large messages get few calls and small ones many (OSU scales by size too)."""
    per_call = 0.0
    for fn in fns:
        mgr.barrier()
        start = time.perf_counter()
        for _ in range(max(warmup, 1)):
            fn()
        per_call = max(per_call, (time.perf_counter() - start) / max(warmup, 1))
    iters = max(min_iters, min(max_iters, int(budget / max(per_call, 1e-7))))
    return int(mgr.broadcast_object(iters))


def interleaved(mgr: Manager, columns: Mapping[str, Callable[[], Any]], *, iters: int, rounds: int
                ) -> dict[str, list[float]]:
    """Seconds per call of each column, one sample per round; within a round the columns run one after the
    other, each after a barrier, each ``iters`` times. The starting column rotates from round to round so no
    column always runs first (right after another column's last, slowest-to-drain call)."""
    names = list(columns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = columns[name]
            mgr.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - start) / iters)
    return samples


def per_unit_rounds(mgr: Manager, methods: Mapping[str, tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]],
                    *, iters: int, rounds: int, warmup: int = 1, verify: Callable[[str], None] | None = None
                    ) -> dict[str, list[float]]:
    """Like ``interleaved`` for work that needs set-up and clean-up around each timed unit (a forward pass
    before a backward, clearing gradients after): each method is (before, unit, after) and only ``unit`` is
    timed, after a barrier, ``iters`` times per round; a sample is the mean per unit of one round.
    ``verify(name)`` runs after each method's first warm-up unit (check results there, untimed)."""
    names = list(methods)
    for name in names:
        before, unit, after = methods[name]
        for i in range(max(warmup, 1 if verify else 0)):
            before()
            unit()
            if verify is not None and i == 0:
                verify(name)
            after()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            before, unit, after = methods[name]
            total = 0.0
            for _ in range(iters):
                before()
                mgr.barrier()
                start = time.perf_counter()
                unit()
                total += time.perf_counter() - start
                after()
            samples[name].append(total / iters)
    return samples


def slowest(mgr: Manager, samples: Mapping[str, list[float]]) -> dict[str, float]:
    """Each column's median over rounds, then the maximum of those over ranks (same keys on every rank)."""
    mine = {name: statistics.median(values) for name, values in samples.items()}
    every = mgr.allgather_object(mine)
    return {name: max(float(rank_medians[name]) for rank_medians in every) for name in mine}


def spread(mgr: Manager, samples: Mapping[str, list[float]]) -> dict[str, float]:
    """Each column's spread over rounds, (max - min) / median, the largest over ranks: how far apart the rounds
    were, the noise a later run's figure must move beyond to count as a change (``report``'s drift table)."""
    mine = {name: (max(v) - min(v)) / statistics.median(v) if v and statistics.median(v) > 0 else 0.0
            for name, v in samples.items()}
    every = mgr.allgather_object(mine)
    return {name: max(float(rank[name]) for rank in every) for name in mine}
