"""Allreduce through the Manager next to the engine's own call, interleaved in one run.

Both sides reduce the same float32 buffer with the same iteration count; rounds alternate (engine, unidist
in place, unidist new tensor) so machine noise hits all columns alike. Rank 0 prints the table; times are
medians over rounds, per call.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import unidist


def engine_allreduce(mgr: Any, t: torch.Tensor) -> Callable[[], None]:
    """The engine's own in-place sum allreduce on t, as a user of that engine would call it."""
    backend = mgr.backend
    if backend == "mpi":
        from mpi4py import MPI

        arr, comm = t.numpy(), mgr._comm
        return lambda: comm.Allreduce(MPI.IN_PLACE, arr, MPI.SUM)
    if backend in ("torch", "deepspeed"):
        dist = mgr._dist
        op = dist.ReduceOp.SUM
        return lambda: dist.all_reduce(t, op)
    if backend == "horovod":
        import horovod.torch as hvd

        return lambda: hvd.allreduce_(t, op=hvd.Sum)
    if backend == "local":
        return lambda: None
    raise SystemExit(f"no engine reference for backend {backend!r}")


def _time(fn: Callable[[], Any], iters: int, barrier: Callable[[], None]) -> float:
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="8,1024,65536,2097152", help="message sizes in bytes (float32)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per column per round (approx.)")
    ns = parser.parse_args(argv)
    with unidist.init() as mgr:
        rows = []
        for nbytes in (int(s) for s in ns.sizes.split(",")):
            t = torch.ones(max(nbytes // 4, 1))
            columns: dict[str, Callable[[], Any]] = {
                "engine": engine_allreduce(mgr, t),
                "unidist_": functools.partial(mgr.allreduce_, t),
                "unidist": functools.partial(mgr.allreduce, t),
            }
            start = time.perf_counter()
            for fn in columns.values():  # warm-up; also calibrates the iteration count
                for _ in range(10):
                    fn()
            per_call = (time.perf_counter() - start) / (10 * len(columns))
            iters = int(mgr.broadcast_object(max(5, min(20000, int(ns.budget / max(per_call, 1e-7))))))
            samples: dict[str, list[float]] = {k: [] for k in columns}
            for _ in range(ns.rounds):
                for name, fn in columns.items():
                    samples[name].append(_time(fn, iters, mgr.barrier))
            med = {k: statistics.median(v) for k, v in samples.items()}
            rows.append((nbytes, iters, med))
        if mgr.is_main:
            print(f"allreduce, float32 sum, backend={mgr.backend}, {mgr.size} ranks, median of {ns.rounds} rounds")
            print(f"{'bytes':>9} {'iters':>6} {'engine us':>10} {'unidist_ us':>12} {'unidist us':>11} "
                  f"{'ratio_':>7} {'ratio':>6} {'engine MB/s':>12} {'unidist_ MB/s':>14}")
            for nbytes, iters, med in rows:
                e, ip, new = med["engine"], med["unidist_"], med["unidist"]
                print(f"{nbytes:>9} {iters:>6} {e * 1e6:>10.2f} {ip * 1e6:>12.2f} {new * 1e6:>11.2f} "
                      f"{ip / e if e else np.nan:>7.2f} {new / e if e else np.nan:>6.2f} "
                      f"{nbytes / e / 1e6 if e else np.nan:>12.1f} {nbytes / ip / 1e6:>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
