"""A model with dropout, numpy noise and ``random`` draws in every step, its data from ``mgr.loader`` (shuffled,
6 batches an epoch at 2 ranks), checkpointed mid-epoch (issue 47 part 4), for tests/multiproc/test_checkpoint_rng.py.

Each rank seeds its three generators with its rank (as scripts do), so every rank's states differ.
``--phase save``: 8 steps uninterrupted (``<out>/whole-rank<R>.pt``: the final weights), then, seeded again, 4
steps and a checkpoint in ``--ckpt`` (with ``loader=``), then 4 more steps (the writer's own continuation; must
equal the whole run). ``--phase resume``: seeded otherwise (the restore must overwrite it), loads the checkpoint
(``loader=``) and takes steps 5-8: ``<out>/resumed-rank<R>.pt``. Each phase also writes the dataset rows each
step read on this rank (``<out>/<kind>-rows-rank<R>.json``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import unidist

parser = argparse.ArgumentParser()
parser.add_argument("--phase", choices=("save", "resume"), required=True)
parser.add_argument("--ckpt", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--stage", type=int, default=0)
args = parser.parse_args(unidist.script_args())
STEPS, SAVE_AT = 8, 4


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


DATA = torch.Generator().manual_seed(100)
DATASET = torch.utils.data.TensorDataset(torch.randn(48, 16, generator=DATA) * 3,
                                         torch.randint(0, 4, (48,), generator=DATA), torch.arange(48))


def batches(loader: object) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, from one iterator (as a training loop's nested for loops read them)."""
    while True:
        yield from loader  # type: ignore[misc]


def steps(mgr: unidist.Manager, model: torch.nn.Module, opt: torch.optim.Optimizer, feed: Iterator[Any], first: int,
          last: int) -> list[list[int]]:
    """Steps [first, last) on the next batches of ``feed``; the rows each read."""
    rows: list[list[int]] = []
    for _ in range(first, last):
        x, y, idx = next(feed)
        noise = torch.from_numpy(np.random.randn(len(x), 16).astype(np.float32)) * random.random()
        opt.zero_grad()
        mgr.backward(torch.nn.functional.cross_entropy(model(x + noise), y))
        opt.step()
        rows.append(idx.tolist())
    return rows


def weights(mgr: unidist.Manager, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in mgr.full_state_dict(model).items()}


with unidist.init() as mgr:
    rows: dict[str, list[list[int]]] = {}
    if args.phase == "save":
        seed(mgr, 0)
        model, opt = build(mgr)
        rows["whole"] = steps(mgr, model, opt, batches(mgr.loader(DATASET, batch_size=4, shuffle=True, seed=5)), 0,
                              STEPS)
        torch.save(weights(mgr, model), args.out / f"whole-rank{mgr.rank}.pt")
        seed(mgr, 0)
        model, opt = build(mgr)
        loader = mgr.loader(DATASET, batch_size=4, shuffle=True, seed=5)
        feed = batches(loader)
        rows["saved"] = steps(mgr, model, opt, feed, 0, SAVE_AT)
        mgr.save_checkpoint(args.ckpt, model, opt, loader=loader)
        rows["continued"] = steps(mgr, model, opt, feed, SAVE_AT, STEPS)
        torch.save(weights(mgr, model), args.out / f"continued-rank{mgr.rank}.pt")
    else:
        seed(mgr, 12345)
        model, opt = build(mgr)
        loader = mgr.loader(DATASET, batch_size=4, shuffle=True, seed=5)
        mgr.load_checkpoint(args.ckpt, model, opt, loader=loader)
        rows["resumed"] = steps(mgr, model, opt, batches(loader), SAVE_AT, STEPS)
        torch.save(weights(mgr, model), args.out / f"resumed-rank{mgr.rank}.pt")
    for kind, got in rows.items():
        (args.out / f"{kind}-rows-rank{mgr.rank}.json").write_text(json.dumps(got))
