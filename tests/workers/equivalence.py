"""N ranks on batch B/N must train exactly like one process on batch B.

Runs under any launcher. Every rank also trains the single-process reference itself (plain torch, no
unidist), then compares. Variants: plain, accumulation (k=2 micro-batches per step equal one doubled
batch), fp16/bf16 compression. Parameters are compared across ranks after every step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import unidist

STEPS, BATCH, DIM = 6, 24, 10


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of (step, micro-step): the same on every rank."""
    g = torch.Generator().manual_seed(step * 100 + micro)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, torch.sin(x[:, :4]) + 0.1 * x[:, 4:8]


def reference(k: int) -> torch.Tensor:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        xs, ys = zip(*(data(step, m) for m in range(k)), strict=True)
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def distributed(mgr: Any, k: int, compression: str) -> tuple[torch.Tensor, float]:
    torch.manual_seed(mgr.rank)  # a different start on each rank: prepare() must broadcast rank 0's
    model = make_model() if mgr.rank == 0 else torch.nn.Sequential(
        torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = mgr.prepare(model, opt, backward_passes_per_step=k, compression=compression)
    per = BATCH // mgr.size
    spread = 0.0
    for step in range(STEPS):
        for m in range(k):
            x, y = data(step, m)
            mine = slice(mgr.rank * per, (mgr.rank + 1) * per)
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
        flat = _flat(mgr, model)
        spread = max(spread, (mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max().item())
    return _flat(mgr, model), spread


def _flat(mgr: Any, model: Any) -> torch.Tensor:
    gathered = getattr(mgr, "gathered_parameters", None)
    module = getattr(model, "module", model)
    if gathered is not None:
        with gathered(module):
            return torch.cat([p.detach().reshape(-1).float().clone() for p in module.parameters()])
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="plain,k2,fp16,bf16")
    ns = parser.parse_args()
    variants = {"plain": (1, "none"), "k2": (2, "none"), "fp16": (1, "fp16"), "bf16": (1, "bf16")}
    with unidist.init() as mgr:
        report: dict[str, Any] = {"backend": mgr.backend, "size": mgr.size}
        for name in ns.variants.split(","):
            k, compression = variants[name]
            try:
                got, spread = distributed(mgr, k, compression)
                want = reference(k)
                report[name] = {"max_diff": (got - want).abs().max().item(), "max_spread": spread}
            except unidist.InvalidArgumentError as err:
                report[name] = {"refused": str(err)}
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
