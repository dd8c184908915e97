"""A DeepSpeed pipeline script's step time: real DeepSpeed's PipelineEngine beside unidist's compat layer.

    python benchmarks/ds_pipeline.py --rounds 3      # 2 stages; deepspeed, then compat on mpi and torch

A script beside the package, not in ``unidist.bench``: it imports the compat layer, which the tools may not.

Each launch runs this file (``--child``) as one script does: a ``PipelineModule`` of ``--blocks`` residual
Linear+Tanh blocks (width ``--width``) in 2 stages, ``train_batch()`` over ``--micro`` micro-batches of 8 rows,
fp32, torch's AdamW. ``real`` imports ``deepspeed`` under the deepspeed launcher; ``compat`` imports
``unidist.compat.deepspeed`` under the mpi and torch backends' launchers (the same script otherwise). Rank 0
reports the median ``train_batch`` time of the steps after ``--warmup``; the table gives each launch's median
over ``--rounds`` launches (the launches alternate within a round, so drifting load hits each alike) and its
ratio to DeepSpeed's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout's unidist, also when a launcher runs this file

__all__ = ["main"]

LAUNCHES = (("deepspeed", "real"), ("mpi", "compat"), ("torch", "compat"))  # backend, which deepspeed


def child(which: str, out: Path, blocks: int, width: int, micro: int, steps: int, warmup: int) -> None:
    """One rank of one launch (see the module docstring)."""
    import torch

    if which == "real":
        import deepspeed

        compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
        if isinstance(compatible, dict):  # its shm inference op: a JIT build (74 s) training never uses
            compatible["deepspeed_shm_comm"] = False
        from deepspeed.pipe import LayerSpec, PipelineModule
    else:
        import unidist.compat.deepspeed as deepspeed  # type: ignore[no-redef]
        from unidist.compat.deepspeed.pipe import LayerSpec, PipelineModule  # type: ignore[assignment]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x))

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = PipelineModule(layers=[LayerSpec(Block) for _ in range(blocks)], num_stages=2, partition_method="uniform",
                         loss_fn=lambda out, y: (out - y).pow(2).mean())
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": micro, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=config)
    rows = engine.train_batch_size() // (engine.world_size // 2)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen)) for _ in range(rows // 8)]
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        engine.train_batch(iter(data))
        times.append(time.perf_counter() - start)
    if engine.global_rank == 0:
        (out / f"{which}.json").write_text(json.dumps({"s": statistics.median(times[warmup:])}))


def _launch(backend: str, which: str, n: int, out: Path, extra: list[str], timeout: float) -> float:
    from unidist import registry
    from unidist.bench.report import Run, run_env
    from unidist.cli import launch_command

    launch = registry.get(backend).launches[0]
    run = Run(backend, launch.launcher, backend, launch.environment(False))
    argv = launch_command(backend, n, str(Path(__file__).resolve()), ["--child", which, "--out", str(out), *extra])
    env = {**run_env(run, n), "UNIDIST_BACKEND": backend}
    (out / f"{which}.json").unlink(missing_ok=True)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not (out / f"{which}.json").exists():
        raise SystemExit(f"ds_pipeline: {' '.join(argv)} (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return float(json.loads((out / f"{which}.json").read_text())["s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/ds_pipeline.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (2 stages x n/2 data parallel)")
    p.add_argument("--rounds", type=int, default=3, help="launches of each")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--micro", type=int, default=8, help="micro-batches per train_batch")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--child", choices=("real", "compat"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)  # the deepspeed launcher appends --local_rank=N to the child
    shape = ["--blocks", str(args.blocks), "--width", str(args.width), "--micro", str(args.micro),
             "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.child:
        child(args.child, args.out, args.blocks, args.width, args.micro, args.steps, args.warmup)
        return 0
    from unidist.bench.machine import line
    from unidist.bench.output import Column, fmt, markdown

    got: dict[str, list[float]] = {b: [] for b, _ in LAUNCHES}
    with tempfile.TemporaryDirectory(prefix="unidist-ds-pipeline-") as tmp:
        for _ in range(args.rounds):
            for backend, which in LAUNCHES:
                got[backend].append(_launch(backend, which, args.nprocs, Path(tmp), shape, args.timeout))
                print(f"  {backend}: {got[backend][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    real = statistics.median(got["deepspeed"])
    rows: list[dict[str, Any]] = [
        {"what": "DeepSpeed's PipelineEngine" if which == "real" else "unidist.compat.deepspeed",
         "launch": registry_launcher(backend), "ms": statistics.median(got[backend]) * 1e3,
         "ratio": statistics.median(got[backend]) / real} for backend, which in LAUNCHES]
    cols: list[Column] = [("what", "engine", str), ("launch", "launcher", str),
                          ("ms", "train_batch ms (median)", fmt(1)), ("ratio", "x DeepSpeed", fmt(2))]
    print(line())
    print(f"bench ds_pipeline: {args.nprocs} ranks (2 stages), {args.blocks} blocks of width {args.width}, "
          f"{args.micro} micro-batches of 8 rows, fp32; {args.rounds} launches each, medians\n")
    print(markdown(cols, rows))
    return 0


def registry_launcher(backend: str) -> str:
    from unidist import registry

    return registry.get(backend).launches[0].launcher


if __name__ == "__main__":
    sys.exit(main())
