"""The torch backend on CUDA (nccl for CUDA tensors, gloo beside it for CPU ones): prepare, allgather, mean,
broadcast_object, a CPU tensor collective, and optimizer state landing on this rank's device. Runs only where
torch sees a GPU (tests/multiproc/test_gpu.py skips otherwise)."""

from __future__ import annotations

from typing import Any

import torch
from common import report_main


def fill(mgr: Any, report: dict[str, Any]) -> None:
    report["device"] = str(mgr.device)
    torch.manual_seed(mgr.rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if mgr.rank == 0:  # state on root only: the others must receive it on their own device
        model.to(mgr.device)(torch.randn(4, 8, device=mgr.device)).sum().backward()
        opt.step()
        opt.zero_grad()
    model, opt = mgr.prepare(model, opt)
    x = torch.randn(6, 8, device=mgr.device)
    for _ in range(3):
        mgr.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in mgr.unwrap(model).parameters()])
    report["param_spread"] = float((mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max())
    report["state_devices"] = sorted({str(v.device) for s in opt.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor) and v.dim() > 0})
    gathered = mgr.allgather(torch.full((mgr.rank + 1, 2), float(mgr.rank), device=mgr.device))
    report["allgather"] = gathered.cpu().tolist()
    report["mean"] = mgr.mean(float(mgr.rank))
    report["object"] = mgr.broadcast_object({"from": mgr.rank}, root=mgr.size - 1)
    report["cpu_allreduce"] = mgr.allreduce(torch.ones(3) * (mgr.rank + 1)).tolist()  # a CPU tensor on a GPU run


if __name__ == "__main__":
    report_main(fill)
