"""Gradient accumulation: the communication ``mgr.accumulate`` saves, per optimizer step of k micro-batches.

    mpiexec -n 2 python -m unidist.bench.accumulate --width 1024 --layers 4 --micro 4 --rounds 3

Two ways to take one optimizer step over k micro-batches, side by side at ZeRO stages 0 and 2:

- ``accumulate``: the k backward passes inside ``with mgr.accumulate(model):``, one reduction on leaving it;
- ``every micro-batch``: what data parallelism without ``no_sync`` does, a reduction after each backward pass
  (``opt.synchronize()`` after each: the same collectives, k times per step).

For each: the watched engine calls per step (``unidist.comm.watchdog.calls``: every collective of unidist's
engines; an async launch and its wait count as two), the gradient bytes reduced per step, and the median step
time over ``--rounds`` interleaved rounds.
unidist's own optimizers (mpi, torch, local, and any backend with ``group=``); rank 0 prints.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

import unidist
from unidist.bench.machine import line as machine_line
from unidist.bench.zero import make_model
from unidist.comm import watchdog

if TYPE_CHECKING:
    from unidist.managers.base import Manager


def run(mgr: Manager, stage: int, blocked: bool, args: argparse.Namespace) -> tuple[list[float], float]:
    """Timed steps of one way; returns (seconds per step, watched calls per step)."""
    model = make_model(args.width, args.layers)
    model, prepared = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-4), zero_stage=stage)
    opt: Any = prepared  # unidist's prepared optimizer: synchronize() beside the torch Optimizer's calls
    x = torch.randn(args.batch, args.width)
    times: list[float] = []
    calls = 0
    for step in range(args.steps + 1):  # the first step warms up: not timed
        mgr.barrier()
        start, before = time.perf_counter(), watchdog.calls()
        if blocked:
            with mgr.accumulate(model):
                for _ in range(args.micro):
                    mgr.backward(model(x).pow(2).mean() / args.micro)
        else:
            for _ in range(args.micro):
                mgr.backward(model(x).pow(2).mean() / args.micro)
                opt.synchronize()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
            calls += watchdog.calls() - before
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return times, calls / args.steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank and micro-batch")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per way and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(unidist.script_args())
    ways = [(stage, blocked) for stage in (0, 2) for blocked in (True, False)]
    with unidist.init() as mgr:
        times: dict[tuple[int, bool], list[float]] = {w: [] for w in ways}
        calls: dict[tuple[int, bool], float] = {}
        for _ in range(args.rounds):
            for stage, blocked in ways:
                t, calls[stage, blocked] = run(mgr, stage, blocked, args)
                times[stage, blocked] += t
        if mgr.is_main:
            psi = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
            print(machine_line(), flush=True)
            print(f"backend={mgr.backend} ranks={mgr.size} Psi={psi} ({psi * 4 / 2**20:.1f} MiB fp32), "
                  f"{args.micro} micro-batches of {args.batch} rows per step; median of {len(times[ways[0]])} steps")
            print("| stage | way | engine calls per step | gradient MiB reduced per step | step ms | vs accumulate |")
            print("|---|---|---|---|---|---|")
            for stage, blocked in ways:
                ms = statistics.median(times[stage, blocked]) * 1e3
                base = statistics.median(times[stage, True]) * 1e3
                reductions = 1 if blocked else args.micro
                print(f"| {stage} | {'accumulate' if blocked else 'every micro-batch'} | "
                      f"{calls[stage, blocked]:.0f} | {reductions * psi * 4 / 2**20:.1f} | {ms:.1f} | "
                      f"{ms / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
