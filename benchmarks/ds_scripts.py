"""DeepSpeed pipeline and Mixture-of-Experts scripts' step time: real DeepSpeed beside unidist's compat layer.

    python benchmarks/ds_scripts.py --kind pipeline --rounds 3   # 2 stages; deepspeed, then compat on mpi, torch
    python benchmarks/ds_scripts.py --kind moe --rounds 3        # a MoE layer, experts over 2 ranks

A script beside the package, not in ``unidist.bench``: it imports the compat layer, which the tools may not.

Each launch runs this file (``--child``) as one script does, fp32, torch's AdamW:

- ``pipeline``: a ``PipelineModule`` of ``--blocks`` residual Linear+Tanh blocks (width ``--width``) in 2 stages,
  ``train_batch()`` over ``--micro`` micro-batches of 8 rows;
- ``moe``: ``--blocks`` residual blocks, each a ``deepspeed.moe.layer.MoE`` (4 experts of a Linear-GELU-Linear of
  width ``--width``, expert-parallel over every rank, top-1) after a Linear; 64 tokens a rank, ``engine.backward``
  and ``engine.step``.

``real`` imports ``deepspeed`` under the deepspeed launcher; ``compat`` imports ``unidist.compat.deepspeed`` under
the mpi and torch backends' launchers (the same script otherwise). Rank 0 reports the median step time of the steps
after ``--warmup``; the table gives each launch's median over ``--rounds`` launches (the launches alternate within
a round, so drifting load hits each alike) and its ratio to DeepSpeed's.
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


def child(which: str, kind: str, out: Path, blocks: int, width: int, micro: int, steps: int, warmup: int) -> None:
    """One rank of one launch (see the module docstring)."""
    if which == "real":
        import deepspeed

        compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
        if isinstance(compatible, dict):  # its shm inference op: a JIT build (74 s) training never uses
            compatible["deepspeed_shm_comm"] = False
    else:
        import unidist.compat.deepspeed as deepspeed  # type: ignore[no-redef]
    deepspeed.init_distributed(dist_backend="gloo")
    times = (_pipeline if kind == "pipeline" else _moe)(deepspeed, blocks, width, micro, warmup + steps)
    if deepspeed.comm.get_rank() == 0:
        (out / f"{which}.json").write_text(json.dumps({"s": statistics.median(times[warmup:])}))


def _pipeline(deepspeed: Any, blocks: int, width: int, micro: int, steps: int) -> list[float]:
    import torch

    pipe = deepspeed.pipe

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x))

    torch.manual_seed(0)
    net = pipe.PipelineModule(layers=[pipe.LayerSpec(Block) for _ in range(blocks)], num_stages=2,
                              partition_method="uniform", loss_fn=lambda out, y: (out - y).pow(2).mean())
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": micro, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=config)
    rows = engine.train_batch_size() // (engine.world_size // 2)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen)) for _ in range(rows // 8)]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_batch(iter(data))
        times.append(time.perf_counter() - start)
    return times


def _moe(deepspeed: Any, blocks: int, width: int, micro: int, steps: int) -> list[float]:
    import torch

    world = deepspeed.comm.get_world_size()

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(width, width)
            expert = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
            self.moe = deepspeed.moe.layer.MoE(hidden_size=width, expert=expert, num_experts=2 * world,
                                               ep_size=world, k=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _, _ = self.moe(torch.tanh(self.fc(x)))
            return x + out  # type: ignore[no-any-return]

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[Block() for _ in range(blocks)])
    config = {"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=config)
    gen = torch.Generator().manual_seed(1 + engine.global_rank)
    x, y = torch.randn(64, width, generator=gen), torch.randn(64, width, generator=gen)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _launch(backend: str, which: str, n: int, out: Path, extra: list[str], timeout: float) -> float:
    from unidist import registry
    from unidist.bench.report import Run, run_env
    from unidist.cli import launch_command

    launch = registry.get(backend).launches[0]
    run = Run(backend, launch.launcher, backend, launch.environment(False))
    argv = launch_command(backend, n, str(Path(__file__).resolve()), ["--child", which, "--out", str(out), *extra])
    env = {**run_env(run, n), "UNIDIST_BACKEND": backend}
    for attempt in range(2):
        (out / f"{which}.json").unlink(missing_ok=True)
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        # real DeepSpeed's processes sometimes abort in gloo's teardown at exit ("terminate called without an
        # active exception", pytorch/pytorch#190489; once in a CI dry run): not unidist's code, run once more
        if proc.returncode == 0 or which != "real" or "terminate called without an active exception" not in \
                proc.stdout + proc.stderr or attempt:
            break
    if proc.returncode != 0 or not (out / f"{which}.json").exists():
        raise SystemExit(f"ds_scripts: {' '.join(argv)} (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return float(json.loads((out / f"{which}.json").read_text())["s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/ds_scripts.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("pipeline", "moe"), default="pipeline")
    p.add_argument("--backends", default="deepspeed,mpi,torch", help="comma-separated; deepspeed (the ratio's base) "
                   "is always run")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (pipeline: 2 stages x n/2 data parallel)")
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
    shape = ["--kind", args.kind, "--blocks", str(args.blocks), "--width", str(args.width), "--micro", str(args.micro),
             "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.child:
        child(args.child, args.kind, args.out, args.blocks, args.width, args.micro, args.steps, args.warmup)
        return 0
    from unidist.bench.machine import line
    from unidist.bench.output import Column, fmt, markdown

    wanted = {"deepspeed", *(b.strip() for b in args.backends.split(",") if b.strip())}
    launches = [(b, which) for b, which in LAUNCHES if b in wanted]
    got: dict[str, list[float]] = {b: [] for b, _ in launches}
    with tempfile.TemporaryDirectory(prefix="unidist-ds-scripts-") as tmp:
        for _ in range(args.rounds):
            for backend, which in launches:
                got[backend].append(_launch(backend, which, args.nprocs, Path(tmp), shape, args.timeout))
                print(f"  {backend}: {got[backend][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    real = statistics.median(got["deepspeed"])
    rows: list[dict[str, Any]] = [
        {"what": "DeepSpeed's own" if which == "real" else "unidist.compat.deepspeed",
         "launch": registry_launcher(backend), "ms": statistics.median(got[backend]) * 1e3,
         "ratio": statistics.median(got[backend]) / real} for backend, which in launches]
    cols: list[Column] = [("what", "engine", str), ("launch", "launcher", str),
                          ("ms", "step ms (median)", fmt(1)), ("ratio", "x DeepSpeed", fmt(2))]
    print(line())
    what = (f"a PipelineModule in 2 stages, {args.blocks} blocks of width {args.width}, {args.micro} micro-batches "
            "of 8 rows per train_batch" if args.kind == "pipeline" else
            f"{args.blocks} MoE blocks of width {args.width}, {2 * args.nprocs} experts over every rank, top-1, 64 "
            "tokens a rank per step")
    print(f"ds_scripts --kind {args.kind}: {args.nprocs} ranks, {what}, fp32; {args.rounds} launches each, medians\n")
    print(markdown(cols, rows))
    return 0


def registry_launcher(backend: str) -> str:
    from unidist import registry

    return registry.get(backend).launches[0].launcher


if __name__ == "__main__":
    sys.exit(main())
