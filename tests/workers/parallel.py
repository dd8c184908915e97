"""Tensor and pipeline parallelism against the dense model in one process (issue 14), on 2 or 4 ranks.

Every rank builds the same dense model from one seed and trains it on the whole batch itself: the reference.
The parallel versions (tensor-parallel over a group, pipelines of 2 and 4 stages under both schedules) must
give the same outputs, gradients, per-step losses and weights (float32, 1e-5), with gradients of realistic
size (norms well above 1). Each case records "ok" or the failure, and its measured differences. Everything runs
on the group's device (a GPU where there is one: the GPU suite, tests/multiproc/test_gpu.py).
"""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any

import torch
from common import report_main

from unidist.errors import InvalidArgumentError
from unidist.parallel import ColumnParallelLinear, Pipeline, RowParallelLinear

TOL = 1e-5
STEPS, LR = 3, 0.05


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    if not diff <= TOL * max(1.0, b.abs().max().item()):
        raise AssertionError(f"{what}: max |diff| {diff:.3g}")
    return diff


def tensor_parallel(group: Any, gather: bool) -> dict[str, Any]:
    """Column(16 -> 64) then Row(64 -> 8) vs the dense pair: forward, gradients, 3 SGD steps."""
    torch.manual_seed(1)
    dev = group.device
    fc1, fc2 = torch.nn.Linear(16, 64).to(dev), torch.nn.Linear(64, 8).to(dev)
    col = ColumnParallelLinear.from_dense(fc1, group, gather_output=gather)
    row = RowParallelLinear.from_dense(fc2, group, input_is_parallel=not gather)
    x = (torch.randn(32, 16, generator=torch.Generator().manual_seed(2)) * 3).to(dev)
    # targets far from the outputs: gradient norms well above 1 (clipping or scaling anywhere would show)
    target = (torch.randn(32, 8, generator=torch.Generator().manual_seed(3)) * 40).to(dev)
    dense_opt = torch.optim.SGD([*fc1.parameters(), *fc2.parameters()], lr=LR)
    tp_opt = torch.optim.SGD([*col.parameters(), *row.parameters()], lr=LR)
    p, r = group.size, group.rank
    rows, cols = slice(r * 64 // p, (r + 1) * 64 // p), slice(r * 64 // p, (r + 1) * 64 // p)
    worst, grad_norm = 0.0, 0.0
    for step in range(STEPS):
        xd, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        dense_out = fc2(torch.tanh(fc1(xd)))
        tp_out = row(torch.tanh(col(xt)))
        worst = max(worst, _close(tp_out, dense_out, f"step {step} forward"))
        torch.nn.functional.mse_loss(dense_out, target).backward()
        torch.nn.functional.mse_loss(tp_out, target).backward()
        grad_norm = max(grad_norm, fc1.weight.grad.norm().item())
        worst = max(worst, _close(xt.grad, xd.grad, f"step {step} input grad"))
        worst = max(worst, _close(col.weight.grad, fc1.weight.grad[rows], f"step {step} column weight grad"))
        worst = max(worst, _close(col.bias.grad, fc1.bias.grad[rows], f"step {step} column bias grad"))
        worst = max(worst, _close(row.weight.grad, fc2.weight.grad[:, cols], f"step {step} row weight grad"))
        worst = max(worst, _close(row.bias.grad, fc2.bias.grad, f"step {step} row bias grad"))
        dense_opt.step()
        tp_opt.step()
        dense_opt.zero_grad()
        tp_opt.zero_grad()
    worst = max(worst, _close(col.weight, fc1.weight[rows], "column weight after the steps"))
    worst = max(worst, _close(row.weight, fc2.weight[:, cols], "row weight after the steps"))
    try:
        ColumnParallelLinear(16, 2 * p + 1, group)
        raise AssertionError("an uneven column split was accepted")
    except InvalidArgumentError as err:
        if "split evenly" not in str(err):
            raise
    return {"max_diff": worst, "first_grad_norm": grad_norm}


class Scale(torch.nn.Module):
    """A per-feature weight: wide activations without a width x width matrix."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _blocks(stages: int, width: int) -> list[torch.nn.Module]:
    torch.manual_seed(5)
    if width > 1024:
        inner: list[torch.nn.Module] = [torch.nn.Sequential(Scale(width), torch.nn.Tanh()) for _ in range(stages - 1)]
    else:
        inner = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(stages - 1)]
    return [*inner, torch.nn.Linear(width, 4)]


def pipeline(group: Any, schedule: str, microbatches: int, width: int = 24, steps: int = STEPS
             ) -> dict[str, Any]:
    """S stages of the dense model; losses and each stage's weights vs the dense model on the whole batch."""
    stages, dev = group.size, group.device
    dense = torch.nn.Sequential(*_blocks(stages, width)).to(dev)
    mine = _blocks(stages, width)[group.rank].to(dev)
    pipe = Pipeline(mine, group, microbatches=microbatches, schedule=schedule,
                    loss_fn=torch.nn.functional.mse_loss)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=LR)
    opt = torch.optim.SGD(mine.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(9)
    worst, seconds = 0.0, []
    for step in range(steps):
        x = (torch.randn(8 * microbatches, width, generator=gen) * 2).to(dev)
        y = (torch.randn(8 * microbatches, 4, generator=gen) * 30).to(dev)
        ref = torch.nn.functional.mse_loss(dense(x), y)
        ref.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        start = time.perf_counter()
        loss = pipe.train_step(x, y)
        seconds.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
        worst = max(worst, _close(torch.tensor(loss), ref.detach().cpu(), f"step {step} loss"))
    for got, want in zip(mine.parameters(), dense[group.rank].parameters(), strict=True):
        worst = max(worst, _close(got.detach(), want.detach(), f"stage {group.rank} weights"))
    stats = pipe.memory_stats()
    want_peak = microbatches if schedule == "gpipe" else min(stages - group.rank, microbatches)
    if stats["peak_activations"] != want_peak:
        raise AssertionError(f"{schedule} stage {group.rank}: peak {stats['peak_activations']} micro-batches "
                             f"alive, expected {want_peak}")
    out = pipe.forward(x)
    worst = max(worst, _close(out, dense(x).detach(), "inference forward"))
    return {"max_diff": worst, "peak_activations": stats["peak_activations"], "busy": stats["busy_seconds"],
            "step": stats["step_seconds"], "median_step": sorted(seconds)[len(seconds) // 2]}


class _Masked(torch.nn.Module):
    """A stage that takes and passes (hidden, mask): the activation is a tuple with an integer part, as Megatron's
    (hidden, attention mask); the last stage returns the masked output."""

    def __init__(self, width: int, last: bool) -> None:
        super().__init__()
        self.fc, self.last = torch.nn.Linear(width, 4 if last else width), last

    def forward(self, x: Any) -> Any:
        h, mask = x if isinstance(x, tuple) else (x, (x[:, :1] > 0).long())
        out = self.fc(h) if self.last else torch.tanh(self.fc(h)) * (1 + mask)
        return out * mask if self.last else (out, mask)


def pipeline_tuple(group: Any, microbatches: int = 4, width: int = 16) -> dict[str, Any]:
    """Stages exchanging (hidden, integer mask) tuples: losses, weights and the first stage's input gradient path
    against the same stages chained in one process."""
    stages, dev = group.size, group.device
    torch.manual_seed(7)
    blocks = [_Masked(width, i == stages - 1).to(dev) for i in range(stages)]
    dense = torch.nn.Sequential(*[copy.deepcopy(b) for b in blocks])
    mine = blocks[group.rank]
    pipe = Pipeline(mine, group, microbatches=microbatches, schedule="1f1b", loss_fn=torch.nn.functional.mse_loss)
    dense_opt, opt = torch.optim.SGD(dense.parameters(), lr=LR), torch.optim.SGD(mine.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(11)
    worst = 0.0
    for step in range(STEPS):
        x = torch.randn(8 * microbatches, width, generator=gen).to(dev)
        y = (torch.randn(8 * microbatches, 4, generator=gen) * 3).to(dev)
        ref = torch.stack([torch.nn.functional.mse_loss(dense(xs), ys)
                           for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)]).mean()
        ref.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        loss = pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()
        worst = max(worst, _close(torch.tensor(loss), ref.detach().cpu(), f"step {step} loss"))
    for got, want in zip(mine.parameters(), dense[group.rank].parameters(), strict=True):
        worst = max(worst, _close(got.detach(), want.detach(), f"stage {group.rank} weights"))
    # evaluation over fewer micro-batches than training's: every stage is told how many (a middle stage has none)
    xs, ys = list(x.chunk(microbatches))[:2], list(y.chunk(microbatches))[:2]
    got_eval = pipe.eval_microbatches(xs if group.rank == 0 else None, ys if group.rank == stages - 1 else None, 2)
    with torch.no_grad():
        want_eval = sum(float(torch.nn.functional.mse_loss(dense(a), b)) for a, b in zip(xs, ys, strict=True)) / 2
    worst = max(worst, _close(torch.tensor(got_eval), torch.tensor(want_eval), "eval over 2 micro-batches"))
    return {"max_diff": worst}


def record(report: dict[str, Any], name: str, fn: Any) -> None:
    try:
        report[name] = {"result": "ok", **fn()}
    except Exception as err:  # recorded per case: the other cases still run
        report[name] = {"result": f"FAIL: {type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}


def fill(mgr: Any, report: dict[str, Any]) -> None:
    record(report, "tp_world_parallel_io", lambda: tensor_parallel(mgr, gather=False))
    record(report, "tp_world_gathered", lambda: tensor_parallel(mgr, gather=True))
    for schedule in ("gpipe", "1f1b"):
        record(report, f"pipeline_{mgr.size}_{schedule}", lambda s=schedule: pipeline(mgr, s, 4))
        # activations of 256 KiB: a blocking send only ends when its recv starts, so the order must be right
        record(report, f"pipeline_{mgr.size}_{schedule}_big", lambda s=schedule: pipeline(mgr, s, 4, 8192, 1))
    record(report, f"pipeline_{mgr.size}_1f1b_m2", lambda: pipeline(mgr, "1f1b", 2))
    record(report, f"pipeline_{mgr.size}_tuple", lambda: pipeline_tuple(mgr))
    if mgr.size == 4:
        pairs = mgr.split(mgr.rank // 2)  # two 2-way groups side by side
        record(report, "tp_pairs", lambda: tensor_parallel(pairs, gather=False))
        for schedule in ("gpipe", "1f1b"):
            record(report, f"pipeline_pairs_{schedule}", lambda s=schedule: pipeline(pairs, s, 4))


if __name__ == "__main__":
    report_main(fill)
