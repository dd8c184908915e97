"""What UNIDIST_CHECK_COLLECTIVES costs: in-place sum allreduce with the check off and on, interleaved.

    mpiexec -n 2 python -m unidist.bench.check        (any launcher; rank 0 prints the table)

Rounds alternate between the two modes on the same buffer, so machine noise hits both alike; times are
medians over rounds, per call. The check adds one two-word MAX allreduce per collective (comm/check.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

import unidist

SIZES = (8, 1024, 65536, 1 << 20, 16 << 20)


def _mode(mgr: Any, checked: bool) -> None:
    mgr.config = dataclasses.replace(mgr.config, check_collectives=checked)
    mgr._enable_fast_path()  # reads the flag


def _time(mgr: Any, t: torch.Tensor, iters: int) -> float:
    mgr.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        mgr.allreduce_(t)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="bytes per buffer")
    args = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        rows = []
        for nbytes in args.sizes:
            t = torch.zeros(max(1, nbytes // 4))
            iters = max(5, min(2000, (64 << 20) // max(nbytes, 1) // 8))
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for checked in (False, True):
                    _mode(mgr, checked)
                    times[checked].append(_time(mgr, t, iters))
            _mode(mgr, False)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            rows.append((nbytes, off, on))
        if mgr.rank == 0:
            print(f"backend={mgr.backend} ranks={mgr.size}: allreduce_ (sum, float32, in place), median per call")
            print(f"{'bytes':>10} {'unchecked us':>13} {'checked us':>11} {'ratio':>6}")
            for nbytes, off, on in rows:
                print(f"{nbytes:>10} {off * 1e6:>13.1f} {on * 1e6:>11.1f} {on / off:>6.2f}")


if __name__ == "__main__":
    main()
