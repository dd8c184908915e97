"""Model parallelism measured: a pipeline over every rank under GPipe and 1F1B, and a tensor-parallel MLP
beside the dense one.

    mpiexec -n 4 python -m unidist.bench.parallel --microbatches 4 8

Pipeline: S = world size stages of ``--width`` square Linear+Tanh layers (``--layers`` per stage), a batch of
``--batch`` rows cut into M micro-batches, SGD. Per schedule and M: the median step time, each stage's
busy share (its own forward and backward compute / the step), the bubble (1 - the mean busy share; the
theory for equal stages is (S - 1) / (M + S - 1)), and the most micro-batches of activations each stage held
at once (GPipe: M; 1F1B: min(S - i, M)). Tensor parallelism: an MLP of Column then Row layers over every rank
beside the same dense MLP in each process, median step time. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

import unidist
from unidist.bench.machine import line as machine_line
from unidist.parallel import ColumnParallelLinear, Pipeline, RowParallelLinear

if TYPE_CHECKING:
    from unidist.managers.base import Manager


def _stage(width: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def pipeline_rows(mgr: Manager, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(mgr.rank)
    rows = []
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    for m in args.microbatches:
        for schedule in ("gpipe", "1f1b"):
            stage = _stage(args.width, args.layers)
            pipe = Pipeline(stage, mgr, microbatches=m, schedule=schedule, loss_fn=torch.nn.functional.mse_loss)
            opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
            steps, busy = [], []
            for i in range(args.steps + 1):
                mgr.barrier()
                start = time.perf_counter()
                pipe.train_step(x, y)
                opt.step()
                opt.zero_grad()
                if i:  # the first step exchanges shapes and warms up
                    steps.append(time.perf_counter() - start)
                    busy.append(pipe.memory_stats()["busy_seconds"])
            step = statistics.median(steps)
            shares = mgr.allgather_object(statistics.median(busy) / step)
            peaks = mgr.allgather_object(pipe.memory_stats()["peak_activations"])
            rows.append({"schedule": schedule, "microbatches": m, "step_ms": step * 1e3,
                         "busy": shares, "bubble": 1 - sum(shares) / len(shares),
                         "theory": (mgr.size - 1) / (m + mgr.size - 1), "peaks": peaks})
    return rows


def tensor_rows(mgr: Manager, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    width, hidden = args.width, 4 * args.width
    up, down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)
    dense = torch.nn.Sequential(up, torch.nn.GELU(), down)
    tp = torch.nn.Sequential(ColumnParallelLinear.from_dense(up, mgr, gather_output=False), torch.nn.GELU(),
                             RowParallelLinear.from_dense(down, mgr, input_is_parallel=True))
    x = torch.randn(args.batch, width)
    out: dict[str, float] = {}
    for name, model in (("dense", dense), ("tensor parallel", tp)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        times = []
        for i in range(args.steps + 1):
            mgr.barrier()
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if i:
                times.append(time.perf_counter() - start)
        out[name] = max(mgr.allgather_object(statistics.median(times))) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2, help="Linear+Tanh layers per stage")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        rows = pipeline_rows(mgr, args)
        tp = tensor_rows(mgr, args)
        if mgr.rank == 0:
            print(machine_line(), flush=True)
            print(f"pipeline: {mgr.size} stages ({mgr.backend}), {args.layers} x Linear({args.width}) + Tanh per "
                  f"stage, batch {args.batch}, median of {args.steps} steps")
            print("| schedule | micro-batches | step ms | busy share per stage | bubble | theory | peak "
                  "activations per stage |")
            print("|---|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['schedule']} | {r['microbatches']} | {r['step_ms']:.1f} | "
                      f"{' / '.join(f'{b:.2f}' for b in r['busy'])} | {r['bubble']:.2f} | {r['theory']:.2f} | "
                      f"{' / '.join(map(str, r['peaks']))} |")
            print(f"\ntensor parallel MLP {args.width} -> {4 * args.width} -> {args.width} over {mgr.size} ranks, "
                  f"batch {args.batch}: dense {tp['dense']:.1f} ms per step, tensor parallel "
                  f"{tp['tensor parallel']:.1f} ms ({tp['tensor parallel'] / tp['dense']:.2f}x)")


if __name__ == "__main__":
    main()
