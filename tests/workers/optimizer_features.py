"""DistributedOptimizer details under a real launcher: unused parameters, no_sync, many small buckets,
optimizer-state broadcast, shard sampler, mean. Results per rank in <out>/rank<R>.json."""

from __future__ import annotations

from typing import Any

import torch
from common import report_main


class TwoHeads(torch.nn.Module):
    """The second head is used only on rank 0: its gradient is missing on the other ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head_a = torch.nn.Linear(8, 1)
        self.head_b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head_a(h) + (self.head_b(h) if use_b else 0)


def spread(mgr: Any, model: torch.nn.Module) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return float((mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max())


def batch(seed: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 6, generator=g)
    return x, x.sum(1, keepdim=True)


def unused_parameters(mgr: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TwoHeads()
    model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=1e-4)
    for step in range(3):
        x, y = batch(step * 10 + mgr.rank)
        loss = torch.nn.functional.mse_loss(model(x, use_b=mgr.rank == 0), y)
        mgr.backward(loss)
        opt.step()
        opt.zero_grad()
    return {"spread": spread(mgr, model), "buckets": len(opt.buckets)}


def no_sync_equals_summed_loss(mgr: Any) -> dict[str, Any]:
    """Two passes (the first under no_sync) then a step == one step on the sum of both losses."""
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 1)
    ref = torch.nn.Linear(6, 1)
    ref.load_state_dict(model.state_dict())
    model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    losses = []
    for p in range(2):
        x, y = batch(100 + p * 10 + mgr.rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if p == 0:
            with opt.no_sync():
                mgr.backward(loss)
                opt.step()  # inside no_sync: nothing happens
                opt.zero_grad()  # ... and gradients are kept
        else:
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss)
    # reference: mean over ranks of (loss0 + loss1) gradients, by hand on every rank
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    total = 0
    for r in range(mgr.size):
        for p in range(2):
            x, y = batch(100 + p * 10 + r)
            total = total + torch.nn.functional.mse_loss(ref(x), y)
    (total / mgr.size).backward()
    ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return {"diff": diff, "spread": spread(mgr, model)}


def _large_loss(model: torch.nn.ModuleList, rank: int) -> torch.Tensor:
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(40 + rank))
    h = torch.tanh(model[0](x))
    loss = 10 * model[1](h).pow(2).sum()
    return loss + model[2](h).sum() if rank != 0 else loss  # model[2] gets no gradient on rank 0


def large_gradient_in_place(mgr: Any) -> dict[str, Any]:
    """A 4.5 MB gradient next to small ones (one of them missing on rank 0): on MPI, from reduce_alone_from up, it is
    reduced in its own storage rather than copied into a bucket. Two steps against the ranks' mean gradient by
    hand."""
    torch.manual_seed(3)
    model = torch.nn.ModuleList([torch.nn.Linear(1024, 1100), torch.nn.Linear(1100, 2), torch.nn.Linear(1100, 1)])
    ref = torch.nn.ModuleList([torch.nn.Linear(1024, 1100), torch.nn.Linear(1100, 2), torch.nn.Linear(1100, 1)])
    ref.load_state_dict(model.state_dict())
    model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    for _ in range(2):
        mgr.backward(_large_loss(model, mgr.rank))
        opt.step()
        opt.zero_grad()
        (sum(_large_loss(ref, r) for r in range(mgr.size)) / mgr.size).backward()  # type: ignore[union-attr]
        ref_opt.step()
        ref_opt.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    big = opt.bucket_of(model[0].weight)
    return {"diff": diff, "spread": spread(mgr, model), "alone": bool(big.inplace), "backend": mgr.backend}


def optimizer_state(mgr: Any) -> dict[str, Any]:
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(mgr.rank + 2):  # a different number of steps, so different state, on each rank
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    mgr.broadcast_optimizer_state(opt, root=0)
    state = opt.state_dict()["state"]
    steps = [float(s["step"]) for s in state.values()]
    avg = torch.cat([s["exp_avg"].reshape(-1) for s in state.values()])
    return {"steps": mgr.allgather_object(steps), "exp_avg_spread":
            float((mgr.allreduce(avg, "max") - mgr.allreduce(avg, "min")).abs().max())}


def sampler(mgr: Any) -> dict[str, Any]:
    s = mgr.shard(103, shuffle=True, seed=5)
    epochs = []
    for epoch in range(2):
        s.set_epoch(epoch)
        epochs.append(mgr.allgather_object(list(s)))
    return {"epochs": epochs, "len": len(s), "mean": mgr.mean(float(mgr.rank))}


def fill(mgr: Any, report: dict[str, Any]) -> None:
    for fn in (unused_parameters, no_sync_equals_summed_loss, large_gradient_in_place, optimizer_state, sampler):
        report[fn.__name__] = fn(mgr)


if __name__ == "__main__":
    report_main(fill)
