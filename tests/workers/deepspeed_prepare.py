"""DeepSpeed ``prepare`` smoke test: a few steps with ZeRO stages 0-3 in one launch.

Each rank starts from a different random model (prepare must make them equal), trains on its own data,
and records per stage: the loss before and after (averaged across ranks) and whether every parameter is
bitwise identical across ranks (full parameters gathered under stage 3).
"""

from __future__ import annotations

import torch
from common import report_main

import unidist


def run_stage(mgr: unidist.DeepSpeedManager, stage: int) -> dict[str, object]:
    torch.manual_seed(100 + mgr.rank)  # deliberately different start on each rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, opt = mgr.prepare(model, opt, zero_stage=stage, clip_grad_norm=10.0)
    gen = torch.Generator().manual_seed(7 + mgr.rank)
    w_true = torch.arange(8, dtype=torch.float32) / 8
    x = torch.randn(16, 8, generator=gen)
    y = x @ w_true[:, None] + 0.5
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        mgr.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(mgr.allreduce(loss.detach().reshape(1), "mean")))
    with mgr.gathered_parameters(mgr.unwrap(engine)):
        flat = torch.cat([p.detach().reshape(-1).float() for p in mgr.unwrap(engine).parameters()])
    spread = (mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max().item()
    return {"first": losses[0], "last": losses[-1], "param_spread": spread, "numel": flat.numel(),
            "optimizer": type(engine.optimizer).__name__}


def fill(mgr: unidist.DeepSpeedManager, report: dict[str, object]) -> None:
    for stage in (0, 1, 2, 3):
        report[f"stage{stage}"] = run_stage(mgr, stage)


if __name__ == "__main__":
    report_main(fill)
