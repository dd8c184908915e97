"""A model with dropout, numpy noise and ``random`` draws in every step, checkpointed mid-run (issue 47 part 4),
for tests/multiproc/test_checkpoint_rng.py.

Each rank seeds its three generators with its rank (as scripts do), so every rank's states differ.
``--phase save``: 8 steps uninterrupted (``<out>/whole-rank<R>.pt``: the final weights), then, seeded again, 4
steps and a checkpoint in ``--ckpt``, then 4 more steps (the writer's own continuation; must equal the whole run).
``--phase resume``: seeded otherwise (the restore must overwrite it), loads the checkpoint and takes steps 5-8:
``<out>/resumed-rank<R>.pt``. Any world size: rows of a step are split over the ranks.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch

import unidist

parser = argparse.ArgumentParser()
parser.add_argument("--phase", choices=("save", "resume"), required=True)
parser.add_argument("--ckpt", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--stage", type=int, default=0)
args = parser.parse_args(unidist.script_args())
STEPS, SAVE_AT, ROWS = 8, 4, 8


def seed(mgr: unidist.Manager, base: int) -> None:
    torch.manual_seed(base + mgr.rank)
    np.random.seed(base + mgr.rank)
    random.seed(base + mgr.rank)


def build(mgr: unidist.Manager) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(3)  # the same weights on every rank, whatever the global generator
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), zero_stage=args.stage)


def step(mgr: unidist.Manager, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    data = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(ROWS, 16, generator=data) * 3, torch.randint(0, 4, (ROWS,), generator=data)
    mine = list(mgr.shard(ROWS, shuffle=False))
    noise = torch.from_numpy(np.random.randn(len(mine), 16).astype(np.float32)) * random.random()
    opt.zero_grad()
    mgr.backward(torch.nn.functional.cross_entropy(model(x[mine] + noise), y[mine]))
    opt.step()


def weights(mgr: unidist.Manager, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in mgr.full_state_dict(model).items()}


with unidist.init() as mgr:
    if args.phase == "save":
        seed(mgr, 0)
        model, opt = build(mgr)
        for i in range(STEPS):
            step(mgr, model, opt, i)
        torch.save(weights(mgr, model), args.out / f"whole-rank{mgr.rank}.pt")
        seed(mgr, 0)
        model, opt = build(mgr)
        for i in range(SAVE_AT):
            step(mgr, model, opt, i)
        mgr.save_checkpoint(args.ckpt, model, opt)
        for i in range(SAVE_AT, STEPS):
            step(mgr, model, opt, i)
        torch.save(weights(mgr, model), args.out / f"continued-rank{mgr.rank}.pt")
    else:
        seed(mgr, 12345)
        model, opt = build(mgr)
        mgr.load_checkpoint(args.ckpt, model, opt)
        for i in range(SAVE_AT, STEPS):
            step(mgr, model, opt, i)
        torch.save(weights(mgr, model), args.out / f"resumed-rank{mgr.rank}.pt")
