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


def engine_allreduce(mgr: Any, t: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The engine's own sum allreduce as its users call it: (in place on t, into a new result)."""
    backend = mgr.backend
    if backend == "mpi":
        from mpi4py import MPI

        arr, comm = t.numpy(), mgr._comm
        return (lambda: comm.Allreduce(MPI.IN_PLACE, arr, MPI.SUM),
                lambda: comm.Allreduce(arr, np.empty_like(arr), MPI.SUM))
    if backend in ("torch", "deepspeed"):
        dist = mgr._dist
        op = dist.ReduceOp.SUM
        return lambda: dist.all_reduce(t, op), lambda: dist.all_reduce(t.clone(), op)
    if backend == "horovod":
        import horovod.torch as hvd

        return lambda: hvd.allreduce_(t, op=hvd.Sum), lambda: hvd.allreduce(t, op=hvd.Sum)
    if backend == "local":
        return lambda: None, lambda: t.clone()
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
            engine_inplace, engine_new = engine_allreduce(mgr, t)
            columns: dict[str, Callable[[], Any]] = {
                "engine_": engine_inplace,
                "unidist_": functools.partial(mgr.allreduce_, t),
                "engine": engine_new,
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
            print(f"allreduce, float32 sum, backend={mgr.backend}, {mgr.size} ranks, median of {ns.rounds} rounds; "
                  "x_ = in place, x = into a new tensor")
            print(f"{'bytes':>9} {'iters':>6} {'engine_ us':>11} {'unidist_ us':>12} {'ratio_':>7} "
                  f"{'engine us':>10} {'unidist us':>11} {'ratio':>6} {'engine_ MB/s':>13} {'unidist_ MB/s':>14}")
            for nbytes, iters, med in rows:
                e_, u_, e, u = med["engine_"], med["unidist_"], med["engine"], med["unidist"]
                print(f"{nbytes:>9} {iters:>6} {e_ * 1e6:>11.2f} {u_ * 1e6:>12.2f} {u_ / e_ if e_ else np.nan:>7.2f} "
                      f"{e * 1e6:>10.2f} {u * 1e6:>11.2f} {u / e if e else np.nan:>6.2f} "
                      f"{nbytes / e_ / 1e6 if e_ else np.nan:>13.1f} {nbytes / u_ / 1e6:>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
