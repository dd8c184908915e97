"""Checkpoint save and load times and sizes, per ZeRO stage, under any launcher.

    mpiexec -n 2 python -m unidist.bench.checkpoint --dir /tmp/ckbench
    mpiexec -n 2 python -m unidist.bench.checkpoint --dir /tmp/ckbench --background

An MLP of ``--layers`` square ``--width`` layers (default 25.2 M parameters) with Adam after one step, saved
and loaded ``--rounds`` times per stage; rank 0 prints the median times, the checkpoint's size on disk and
the largest file (one rank's shard).

``--background``: background saves (``blocking=False``) at ``--stage``:
training step time while one is written against a normal step, and save throughput against ``torch.save`` of
the same tensors (each rank its shard) to the same directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import unidist
import unidist.checkpoint.background as bg
from unidist.bench.machine import line as machine_line

if TYPE_CHECKING:
    from unidist.managers.base import Manager


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory (removed afterwards)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--background", action="store_true", help="background saves: step time and throughput")
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage of --background")
    parser.add_argument("--batch", type=int, default=64, help="rows per rank and step, --background")
    parser.add_argument("--steps", type=int, default=5, help="timed normal steps per round, --background")
    parser.add_argument("--writer-nice", type=int, default=None, help="the writer thread's added nice value "
                        "(default: unidist.checkpoint.background.WRITER_NICE)")
    parser.add_argument("--writer-duty", type=float, default=None, help="the fraction of the time the writer "
                        "writes while training runs (default: unidist.checkpoint.background.WRITER_DUTY)")
    args = parser.parse_args(unidist.script_args())
    if args.background:
        return background(args)
    with unidist.init() as mgr:
        rows = []
        for stage in range(4):
            model = make_model(args.width, args.layers)
            model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4), zero_stage=stage)
            mgr.backward(model(torch.randn(4, args.width, device=mgr.device)).pow(2).mean())  # prepare moved it there
            opt.step()
            opt.zero_grad()
            saves, loads = [], []
            path = args.dir / f"stage{stage}"
            for _ in range(args.rounds):
                mgr.barrier()
                start = time.perf_counter()
                mgr.save_checkpoint(path, model, opt)
                saves.append(time.perf_counter() - start)
                mgr.barrier()
                start = time.perf_counter()
                mgr.load_checkpoint(path, model, opt)
                loads.append(time.perf_counter() - start)
            if mgr.is_main:
                files = list(path.iterdir())
                total = sum(f.stat().st_size for f in files)
                biggest = max(f.stat().st_size for f in files)
                rows.append((stage, statistics.median(saves), statistics.median(loads), total, biggest))
            if hasattr(opt, "remove_hooks"):
                opt.remove_hooks()
            del model, opt
        if mgr.is_main:
            psi = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
            print(f"backend={mgr.backend} ranks={mgr.size} Psi={psi / 1e6:.1f} M parameters, Adam; medians of "
                  f"{args.rounds}")
            print("| stage | save s | load s | checkpoint MiB | largest file MiB |")
            print("|---|---|---|---|---|")
            for stage, save, load, total, biggest in rows:
                print(f"| {stage} | {save:.2f} | {load:.2f} | {total / 2**20:.1f} | {biggest / 2**20:.1f} |")
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


def _slowest(mgr: Manager, seconds: float) -> float:
    """The slowest rank's time: the ranks write at once, and the job waits for the last."""
    return float(mgr.allreduce(torch.tensor([seconds], dtype=torch.float64), "max").item())


def _torch_save(obj: Any, path: Path, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def background(args: argparse.Namespace) -> int:
    """Step time during a background save against a normal step; save throughput against torch.save."""
    if args.writer_nice is not None:
        bg.WRITER_NICE = args.writer_nice
    if args.writer_duty is not None:
        bg.WRITER_DUTY = args.writer_duty
    load_before = os.getloadavg()
    with unidist.init() as mgr:
        model = make_model(args.width, args.layers)
        model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4), zero_stage=args.stage)
        x = torch.randn(args.batch, args.width, device=mgr.device)  # where prepare put the model (a GPU if any)

        def step() -> float:
            start = time.perf_counter()
            mgr.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - start

        for _ in range(2):
            step()
        t: dict[str, list[float]] = {k: [] for k in ("normal", "during", "call", "overlapped", "alone", "blocking",
                                                      "torch.save", "torch.save+fsync")}
        for r in range(args.rounds):
            mgr.barrier()
            t["normal"] += [step() for _ in range(args.steps)]
            mgr.barrier()
            start = time.perf_counter()
            handle = mgr.save_checkpoint(args.dir / f"bg-{r}", model, opt, keep=1, blocking=False)
            t["call"].append(time.perf_counter() - start)
            # train until every rank's writer is done (decided together: the ranks step in lockstep)
            while not mgr.allreduce(torch.tensor([float(handle.done())]), "min").item():
                t["during"].append(step())
            handle.wait()
            t["overlapped"].append(_slowest(mgr, time.perf_counter() - start))
            mgr.barrier()
            start = time.perf_counter()
            mgr.save_checkpoint(args.dir / f"bg-{r}-alone", model, opt, keep=1, blocking=False).wait()
            t["alone"].append(_slowest(mgr, time.perf_counter() - start))
            mgr.barrier()
            start = time.perf_counter()
            path = mgr.save_checkpoint(args.dir / f"sync-{r}", model, opt, keep=1)
            t["blocking"].append(_slowest(mgr, time.perf_counter() - start))
            shard = torch.load(path / f"shard-{mgr.rank:05d}-of-{mgr.size:05d}.pt", weights_only=True)
            for name, fsync in (("torch.save", False), ("torch.save+fsync", True)):
                mgr.barrier()
                start = time.perf_counter()
                _torch_save(shard, args.dir / f"torch-{mgr.rank}.pt", fsync)
                t[name].append(_slowest(mgr, time.perf_counter() - start))
            del shard
        ckpt_bytes = sum(f.stat().st_size for f in path.iterdir())
        shard_bytes = mgr.allreduce(torch.tensor([(args.dir / f"torch-{mgr.rank}.pt").stat().st_size],
                                                 dtype=torch.float64), "sum").item()
        if mgr.is_main:
            load_after = os.getloadavg()
            med = {k: statistics.median(v) if v else float("nan") for k, v in t.items()}
            psi = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
            print(machine_line(), flush=True)
            print(f"backend={mgr.backend} ranks={mgr.size} stage={args.stage} Psi={psi / 1e6:.1f} M parameters, "
                  f"Adam, {args.batch} rows per rank; checkpoint {ckpt_bytes / 2**20:.1f} MiB; writer nice "
                  f"+{bg.WRITER_NICE}, duty {bg.WRITER_DUTY:g}; load average {load_before[0]:.1f} before, "
                  f"{load_after[0]:.1f} after; medians of {args.rounds} rounds")
            print("| measure | median | per step / throughput | vs |")
            print("|---|---|---|---|")
            print(f"| training step, no save | {med['normal'] * 1e3:.1f} ms ({len(t['normal'])} steps) | | 1.00x |")
            print(f"| training step while a background save is written | {med['during'] * 1e3:.1f} ms "
                  f"({len(t['during'])} steps) | | {med['during'] / med['normal']:.2f}x |")
            print(f"| save_checkpoint(blocking=False) returns (the snapshot) | {med['call'] * 1e3:.1f} ms | | "
                  f"{med['call'] / med['normal']:.2f} steps |")
            rows = [("background save, training alongside (call to published)", "overlapped", ckpt_bytes),
                    ("background save alone (call + wait)", "alone", ckpt_bytes),
                    ("save_checkpoint (blocking)", "blocking", ckpt_bytes),
                    ("torch.save of the same tensors (each rank its shard)", "torch.save", shard_bytes),
                    ("torch.save + fsync", "torch.save+fsync", shard_bytes)]
            base = shard_bytes / med["torch.save"]
            for label, key, nbytes in rows:
                rate = nbytes / med[key]
                print(f"| {label} | {med[key]:.3f} s | {rate / 1e9:.2f} GB/s | {rate / base:.0%} of torch.save |")
        mgr.barrier()
        if mgr.is_main:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
