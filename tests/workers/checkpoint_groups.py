"""Checkpoints of models prepared with ``group=`` inside a tensor-parallel job (4 ranks: 2-way tensor parallel
within {0, 1} and {2, 3}, 2-way data parallel across them, as examples/hybrid_mlp.py).

    --save-stage S --load-stage T --dir D --out O

Trains the hybrid MLP with Adam for 3 steps at ZeRO stage S over its data-parallel group, saves; then a fresh
hybrid model (other initial weights) prepared at stage T loads the checkpoint and trains to step 6. The
reference is independent: the dense MLP trained in this process on the whole batch; each rank compares its
tensor-parallel shard with the dense weights. Finally a model prepared over the whole world (one data-parallel
part) must refuse the two-part checkpoint on every rank. Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import unidist
from unidist.parallel import ColumnParallelLinear, RowParallelLinear

IN, HIDDEN, OUT, BATCH, SAVE_AT, STEPS = 16, 64, 4, 32, 3, 6


def dense_mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))


def hybrid(dense: torch.nn.Sequential, tp: Any) -> torch.nn.Sequential:
    return torch.nn.Sequential(ColumnParallelLinear.from_dense(dense[0], tp, gather_output=False), torch.nn.GELU(),
                               RowParallelLinear.from_dense(dense[2], tp, input_is_parallel=True))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=gen) * 2, torch.randn(BATCH, OUT, generator=gen) * 10


def train(mgr: Any, dp: Any, model: Any, opt: Any, steps: range) -> None:
    rows = slice(dp.rank * BATCH // dp.size, (dp.rank + 1) * BATCH // dp.size)
    for step in steps:
        x, y = batch(step)
        mgr.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
        opt.step()
        opt.zero_grad()


def shard_diff(mgr: Any, model: Any, dense: torch.nn.Sequential, tp: Any) -> float:
    shard = slice(tp.rank * HIDDEN // tp.size, (tp.rank + 1) * HIDDEN // tp.size)
    full = mgr.full_state_dict(model)
    pairs = [(full["0.weight"], dense[0].weight[shard]), (full["0.bias"], dense[0].bias[shard]),
             (full["2.weight"], dense[2].weight[:, shard]), (full["2.bias"], dense[2].bias)]
    return max(float((a - b.detach()).abs().max()) for a, b in pairs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-stage", type=int, required=True)
    parser.add_argument("--load-stage", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args()
    with unidist.init() as mgr:
        if mgr.size != 4:
            print("checkpoint_groups.py needs 4 ranks", file=sys.stderr)
            return 2
        tp, dp = mgr.split(mgr.rank // 2), mgr.split(mgr.rank % 2)
        reference = dense_mlp(0)
        ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
        for step in range(STEPS):
            x, y = batch(step)
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()

        model = hybrid(dense_mlp(0), tp)
        model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), zero_stage=ns.save_stage,
                                 group=dp)
        train(mgr, dp, model, opt, range(SAVE_AT))
        path = mgr.save_checkpoint(ns.dir / "step-3", model, opt, step=SAVE_AT)

        fresh = hybrid(dense_mlp(1), tp)  # other weights: only the load can make it match
        fresh, fresh_opt = mgr.prepare(fresh, torch.optim.Adam(fresh.parameters(), lr=1e-2),
                                       zero_stage=ns.load_stage, group=dp)
        extra = mgr.load_checkpoint(path, fresh, fresh_opt)
        train(mgr, dp, fresh, fresh_opt, range(extra["step"], STEPS))
        report: dict[str, Any] = {"resumed_from": extra["step"], "diff": shard_diff(mgr, fresh, reference, tp)}

        world = hybrid(dense_mlp(0), tp)
        world, world_opt = mgr.prepare(world, torch.optim.Adam(world.parameters(), lr=1e-2))
        try:
            mgr.load_checkpoint(path, world, world_opt)
            report["world_load"] = "loaded"
        except unidist.UnidistError as err:
            report["world_load"] = f"{type(err).__name__}: {err}"
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
