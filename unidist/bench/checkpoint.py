"""Checkpoint save and load times and sizes, per ZeRO stage, under any launcher.

    mpiexec -n 2 python -m unidist.bench.checkpoint --dir /tmp/ckbench

An MLP of ``--layers`` square ``--width`` layers (default 25.2 M parameters) with Adam after one step, saved
and loaded ``--rounds`` times per stage; rank 0 prints the median times, the checkpoint's size on disk and
the largest file (one rank's shard).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

import unidist


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory (removed afterwards)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        rows = []
        for stage in range(4):
            model = make_model(args.width, args.layers)
            model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4), zero_stage=stage)
            mgr.backward(model(torch.randn(4, args.width)).pow(2).mean())
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


if __name__ == "__main__":
    raise SystemExit(main())
