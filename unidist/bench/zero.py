"""ZeRO stages 0-3 side by side: what each rank holds, beside the ZeRO paper's model, and the step time.

    mpiexec -n 2 python -m unidist.bench.zero --width 1024 --steps 6 --rounds 3

An MLP of ``--layers`` square ``--width`` layers trained with Adam. For each stage: this rank's parameter,
gradient and optimizer-state bytes after the gradient reduction of a step (``mgr.memory_stats``), the
paper's fp32 model for the same Psi and N (stage 0: 4Psi + 4Psi + 8Psi; stage 1 optimizer 8Psi/N; stage 2
also gradients 4Psi/N; stage 3 also parameters 4Psi/N), and the median step time over ``--rounds``
interleaved rounds (stage 0, 1, 2, 3, stage 0, ...) so machine noise hits every stage alike. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

import unidist
from unidist.bench.machine import line as machine_line

if TYPE_CHECKING:
    from unidist.managers.base import Manager


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def run_stage(mgr: Manager, stage: int, args: argparse.Namespace) -> tuple[dict[str, int], list[float]]:
    model = make_model(args.width, args.layers)
    model, prepared = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4), zero_stage=stage)
    opt: Any = prepared  # unidist's prepared optimizer: synchronize() beside the torch Optimizer's calls
    x = torch.randn(args.batch, args.width)
    times: list[float] = []
    stats: dict[str, int] = {}
    for step in range(args.steps + 1):  # the first step builds optimizer state: not timed
        mgr.barrier()
        start = time.perf_counter()
        mgr.backward(model(x).pow(2).mean())
        opt.synchronize()
        if step == args.steps:
            stats = mgr.memory_stats()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return stats, times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per stage and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        stats: dict[int, dict[str, int]] = {}
        times: dict[int, list[float]] = {s: [] for s in range(4)}
        for _ in range(args.rounds):
            for stage in range(4):
                stats[stage], t = run_stage(mgr, stage, args)
                times[stage] += t
        if mgr.is_main:
            psi = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
            n = mgr.size
            paper = {0: (4, 4, 8), 1: (4, 4, 8 / n), 2: (4, 4 / n, 8 / n), 3: (4 / n, 4 / n, 8 / n)}
            base = statistics.median(times[0])
            print(machine_line(), flush=True)
            print(f"backend={mgr.backend} ranks={n} Psi={psi} ({psi * 4 / 2**20:.1f} MiB fp32), Adam; MiB per rank "
                  "measured (paper model); step time median of "
                  f"{len(times[0])}")
            print("| stage | parameters | gradients | optimizer state | step ms | vs stage 0 |")
            print("|---|---|---|---|---|---|")
            for stage in range(4):
                m = stats[stage]
                cells = [f"{m[key] / 2**20:.2f} ({k * psi / 2**20:.2f})" for key, k in
                         zip(("param_bytes", "grad_bytes", "optimizer_bytes"), paper[stage], strict=True)]
                ms = statistics.median(times[stage])
                print(f"| {stage} | {' | '.join(cells)} | {ms * 1e3:.1f} | {ms / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
