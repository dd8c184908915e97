"""The collectives sweep's labels are exact and it says how long it takes (issue 26, part 5)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from unidist.bench.collectives import default_sizes, estimate_seconds, planned
from unidist.bench.output import human_bytes


def test_size_labels_are_exact() -> None:
    assert [human_bytes(n) for n in (4, 8, 1536, 2 << 20, 128 << 20, 3 << 30)] == \
        ["4 B", "8 B", "1.5 KiB", "2 MiB", "128 MiB", "3 GiB"]
    # 4 MiB of float32 in whole chunks for 3 ranks is 12 bytes short: not "4 MiB"
    assert human_bytes((4 << 20) // 4 // 3 * 3 * 4) == "4,194,300 B"
    assert human_bytes(1025) == "1,025 B" and human_bytes(0) == "0 B"
    assert human_bytes(12345.6) == "12.06 KiB"  # a fitted (fractional) size keeps four digits


def test_sizes_that_make_the_same_buffer_are_timed_once() -> None:
    """On 2 ranks allgather's 4 B is one float per rank: 8 B, as its 8 B is; one row, labelled 8 B."""
    mgr = SimpleNamespace(size=2)
    cells = planned(mgr, ["allreduce", "allgather"], [4, 8, 16])
    assert cells == [("allreduce", 4), ("allreduce", 8), ("allreduce", 16), ("allgather", 4), ("allgather", 16)]
    # 3 ranks: 4 to 16 B are all 3 floats (12 B), 24 B is 6
    assert planned(SimpleNamespace(size=3), ["alltoall"], [4, 8, 12, 16, 24]) == [("alltoall", 4), ("alltoall", 24)]


def test_the_default_sweep_announces_minutes() -> None:
    args = argparse.Namespace(budget=0.2, rounds=5)
    cells = len(planned(SimpleNamespace(size=2), ["allreduce", "allgather", "broadcast", "reduce_scatter",
                                                    "alltoall"], default_sizes(4, 128 << 20)))
    assert 80 <= cells <= 85
    assert 60 <= estimate_seconds(cells, 1, args) <= 180
