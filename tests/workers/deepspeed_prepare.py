"""DeepSpeed ``prepare`` smoke test: a few steps with ZeRO stages 0-3 in one launch.

Each rank starts from a different random model (prepare must make them equal), trains on its own data,
and records per stage: the loss before and after (averaged across ranks) and whether every parameter is
bitwise identical across ranks (full parameters gathered under stage 3).

Also ``prepare(reducer=...)`` at stage 0: DeepSpeed's own allreduce against unidist's buckets on the same engine
(gradient norms well above 1, so a clip or a rescale would show), and the refusals.
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


def train_with(mgr: unidist.DeepSpeedManager, reducer: str) -> tuple[torch.Tensor, bool, float]:
    """(final parameters, whether the engine's own allreduce stayed on, the first global gradient norm)."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    engine, opt = mgr.prepare(model, opt, reducer=reducer, bucket_mb=0.001)  # several buckets
    gen = torch.Generator().manual_seed(11 + mgr.rank)
    x = torch.randn(12, 8, generator=gen)
    y = 30.0 * torch.randn(12, 3, generator=gen)  # large targets: gradient norms far above DeepSpeed's clip of 1
    norm = 0.0
    for i in range(5):
        mgr.backward(torch.nn.functional.mse_loss(engine(x), y))
        if i == 0:
            norm = float(torch.cat([p.grad.reshape(-1) for p in mgr.unwrap(engine).parameters()]).norm())
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in mgr.unwrap(engine).parameters()])
    return flat, bool(engine.enable_backward_allreduce), norm


def reducers(mgr: unidist.DeepSpeedManager) -> dict[str, object]:
    mine, mine_on, norm = train_with(mgr, "auto")
    theirs, theirs_on, _ = train_with(mgr, "engine")
    out: dict[str, object] = {"auto_engine_allreduce_on": mine_on, "engine_allreduce_on": theirs_on,
                              "first_grad_norm": norm, "max_diff": float((mine - theirs).abs().max()),
                              "spread": float((mgr.allreduce(mine, "max") - mgr.allreduce(mine, "min")).abs().max())}
    model = torch.nn.Linear(2, 2)
    for name, kwargs in {"bad": {"reducer": "fastest"}, "zero1": {"reducer": "unidist", "zero_stage": 1}}.items():
        try:
            mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)  # type: ignore[arg-type]
            out[name] = "accepted"
        except unidist.InvalidArgumentError as err:
            out[name] = str(err)
    return out


def fill(mgr: unidist.DeepSpeedManager, report: dict[str, object]) -> None:
    for stage in (0, 1, 2, 3):
        report[f"stage{stage}"] = run_stage(mgr, stage)
    report["reducers"] = reducers(mgr)


if __name__ == "__main__":
    report_main(fill)
