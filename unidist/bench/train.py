"""``train``: training throughput of one fixed model and batch, through unidist and through the engines'
own data parallelism.

    torchrun --standalone --nproc_per_node 2 -m unidist.bench train

The model is torchvision's resnet18 layout written in code (``models.resnet``; ``--scale`` shrinks its
widths), on synthetic 3x64x64 images, ``--batch`` images per rank, cross entropy, SGD with momentum.
Implementations (``--impl``; ``all``, the default, runs those this launch supports):

- ``unidist``: ``mgr.prepare``, ``mgr.backward(loss)``, ``opt.step()``, ``opt.zero_grad()`` on whatever
  backend the launch gives;
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gloo), where torch.distributed is initialised
  (the torch backend under torchrun or ``UNIDIST_BACKEND=torch mpiexec``; deepspeed);
- the backend's own name (``horovod``), where its record has a ``raw.optimizer``: the engine's own data
  parallelism as its examples write it (Horovod: ``hvd.broadcast_parameters`` and ``hvd.DistributedOptimizer``;
  horovodrun, or ``UNIDIST_BACKEND=horovod mpiexec``).

After ``--warmup`` untimed steps each, the implementations take turns for ``--rounds`` rounds of ``--steps``
steps (so machine noise hits them alike); samples/s counts every rank's images: ranks x batch / step time
(the slowest rank's median).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unidist import registry
from unidist.bench.output import Column, fmt, markdown
from unidist.bench.real_models import resnet
from unidist.bench.timing import per_unit_rounds, slowest

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["add_arguments", "impls", "run", "table"]

_CLASSES = 1000


def impls() -> tuple[str, ...]:
    """The implementations: unidist's, DDP's, and each registered backend's own (its record's ``raw.optimizer``),
    named after the backend."""
    return ("unidist", "ddp", *(rec.name for rec in registry.records() if rec.raw.optimizer is not None))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", choices=[*impls(), "all"], default="all")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation and round")
    parser.add_argument("--batch", type=int, default=32, help="images per rank")
    parser.add_argument("--image-size", type=int, default=64)


def available(mgr: Manager) -> dict[str, str]:
    """The implementations this launch can run, with why the others cannot."""
    ddp = torch.distributed.is_available() and torch.distributed.is_initialized()
    own = {name: "" if mgr.backend == name else f"needs the {name} backend" for name in impls()[2:]}
    return {"unidist": "", "ddp": "" if ddp else "needs torch.distributed (torch or deepspeed backend)", **own}


def _step_fn(mgr: Manager, impl: str, scale: float, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    model = resnet(scale=scale, classes=_CLASSES).to(mgr.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = x.to(mgr.device), y.to(mgr.device)
    if impl == "unidist":
        prepared, popt = mgr.prepare(model, opt)

        def unidist_step() -> None:
            mgr.backward(torch.nn.functional.cross_entropy(prepared(x), y))
            popt.step()
            popt.zero_grad()
        return unidist_step
    if impl == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)

        def ddp_step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return ddp_step
    own = registry.get(mgr.backend).raw.optimizer
    if impl == mgr.backend and own is not None:
        engine_opt = own(mgr, model, opt)

        def engine_step() -> None:
            engine_opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            engine_opt.step()
        return engine_step
    raise SystemExit(f"train: unknown --impl {impl!r}")


def run(mgr: Manager, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per implementation: step time and samples/s."""
    can = available(mgr)
    why = can.get(args.impl, f"no such implementation (use {', '.join(can)})") if args.impl != "all" else ""
    if why:
        raise SystemExit(f"train --impl {args.impl}: {why} (this run: backend {mgr.backend})")
    chosen = [i for i in impls() if not can[i]] if args.impl == "all" else [args.impl]
    gen = torch.Generator().manual_seed(1000 + mgr.rank)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen)
    y = torch.randint(0, _CLASSES, (args.batch,), generator=gen)
    nothing: Callable[[], None] = lambda: None  # noqa: E731
    methods = {impl: (nothing, _step_fn(mgr, impl, args.scale, x, y), nothing) for impl in chosen}
    med = slowest(mgr, per_unit_rounds(mgr, methods, iters=args.steps, rounds=args.rounds,
                                       warmup=max(1, args.warmup)))
    nparams = sum(p.numel() for p in resnet(scale=args.scale, classes=_CLASSES).parameters())
    base = med.get("ddp")
    rows = []
    for impl, seconds in med.items():
        row: dict[str, Any] = {"bench": "train", "impl": impl, "model": "resnet18", "scale": args.scale,
                               "params": nparams, "image_size": args.image_size, "batch_per_rank": args.batch,
                               "steps": args.steps, "rounds": args.rounds, "step_ms": seconds * 1e3,
                               "samples_per_s": args.batch * mgr.size / seconds}
        if base:
            row["vs_ddp"] = base / seconds
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], run_meta: dict[str, Any]) -> str:
    cols: list[Column] = [("impl", "implementation", str), ("params", "parameters", lambda v: f"{v / 1e6:.2f} M"),
                          ("batch_per_rank", "batch/rank", str), ("step_ms", "step ms", fmt(1)),
                          ("samples_per_s", "samples/s", fmt(1)), ("vs_ddp", "vs DDP", fmt(2))]
    head = (f"train: backend={run_meta['backend']} launcher={run_meta['launcher']} ranks={run_meta['ranks']}, "
            f"resnet18 layout on {rows[0]['image_size'] if rows else '?'}px synthetic images, SGD momentum; "
            f"slowest rank's median step of {rows[0]['rounds'] if rows else 0} interleaved rounds")
    return head + "\n\n" + markdown(cols, rows)
