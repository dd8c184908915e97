"""hvd.DistributedOptimizer through HorovodManager: a few steps, parameters must agree across ranks.

Ranks start from different random models and see different data; prepare() broadcasts rank 0's
parameters, and the averaged gradients keep every rank's parameters identical after each step.
"""

from __future__ import annotations

import torch
from common import report_main

import unidist


def train(mgr: unidist.HorovodManager, compression: str, k: int) -> dict[str, object]:
    torch.manual_seed(11 + mgr.rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    model, opt = mgr.prepare(model, opt, compression=compression, backward_passes_per_step=k)
    gen = torch.Generator().manual_seed(3 + mgr.rank)
    x = torch.randn(32, 6, generator=gen)
    y = torch.stack([x[:, 0] - x[:, 1], x[:, 2] * 0.5], dim=1)
    losses, spreads = [], []
    for step in range(6 * k):  # the uniform loop: step()/zero_grad() after every backward
        loss = torch.nn.functional.mse_loss(model(x), y)
        mgr.backward(loss)
        opt.step()
        opt.zero_grad()
        if (step + 1) % k == 0:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            spreads.append((mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max().item())
            losses.append(float(mgr.allreduce(loss.detach().reshape(1), "mean")))
    return {"losses": losses, "max_spread": max(spreads)}


def fill(mgr: unidist.HorovodManager, report: dict[str, object]) -> None:
    for compression in ("none", "fp16"):
        for k in (1, 2):
            report[f"{compression}-k{k}"] = train(mgr, compression, k)
    try:
        mgr.distributed_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), compression="bf16")
        report["bf16"] = "accepted"
    except unidist.InvalidArgumentError as err:
        report["bf16"] = str(err)


if __name__ == "__main__":
    report_main(fill)
