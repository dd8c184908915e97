"""A model with a Mixture-of-Experts layer (4 experts) saved and loaded through ``mgr.save_checkpoint`` /
``load_checkpoint`` under any launcher, for tests/multiproc/test_moe_checkpoint.py.

``--phase save``: 3 Adam steps, a checkpoint, then 2 more steps; writes ``<out>/saved-rank<R>.pt`` (every tensor
of the model and Adam's ``exp_avg`` at the checkpoint, experts under their index in the layer, computed here from
the placement rule: the rank at place ``rank % ep`` of its expert-parallel group holds experts ``place * 4/ep + i``)
and ``<out>/final-rank<R>.pt`` (the weights after the 5 steps).
``--phase resume``: a fresh model loads the checkpoint and takes the 2 last steps: ``<out>/resumed-rank<R>.pt``.
``--phase load``: a fresh model (maybe another world size and ``--ep``) loads it: ``<out>/loaded-rank<R>.pt``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

import unidist
from unidist.parallel import MoE

EXPERTS = 4
parser = argparse.ArgumentParser()
parser.add_argument("--phase", choices=("save", "resume", "load"), required=True)
parser.add_argument("--ep", type=int, required=True)
parser.add_argument("--ckpt", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args(unidist.script_args())


class Net(torch.nn.Module):
    def __init__(self, mgr: unidist.Manager) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.moe = MoE(8, torch.nn.Linear(8, 8), num_experts=EXPERTS, ep_size=args.ep, k=1, min_capacity=16,
                       group=mgr)
        torch.manual_seed(1 + mgr.rank)  # each rank's experts start apart, so a mix-up shows
        with torch.no_grad():
            for p in self.moe.deepspeed_moe.experts.parameters():
                p.normal_()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(torch.relu(self.inp(x)))[0])


def global_name(name: str, rank: int) -> str:
    """An expert parameter's name by its index in the layer (the test's own arithmetic, not unidist's)."""
    per_rank = EXPERTS // args.ep
    m = re.search(r"deepspeed_experts\.(\d+)\.", name)
    if m is None:
        return name
    g = (rank % args.ep) * per_rank + int(m.group(1))
    return f"{name[:m.start(1)]}{g}{name[m.end(1):]}"


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> dict[str, torch.Tensor]:
    out = {global_name(k, rank): v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out[f"exp_avg:{global_name(name, rank)}"] = opt.state[p]["exp_avg"].detach().clone()
    return out


def step(mgr: unidist.Manager, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i * 10 + mgr.rank)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
    mgr.backward(torch.nn.functional.cross_entropy(model(x), y))
    opt.step()
    opt.zero_grad()


with unidist.init() as mgr:
    model = Net(mgr)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = mgr.prepare(model, opt)
    if args.phase == "save":
        for i in range(3):
            step(mgr, model, opt, i)
        mgr.save_checkpoint(args.ckpt, model, opt)
        torch.save(snapshot(model, opt, mgr.rank), args.out / f"saved-rank{mgr.rank}.pt")
        for i in range(3, 5):
            step(mgr, model, opt, i)
        torch.save(snapshot(model, opt, mgr.rank), args.out / f"final-rank{mgr.rank}.pt")
    else:
        mgr.load_checkpoint(args.ckpt, model, opt)
        if args.phase == "resume":
            for i in range(3, 5):
                step(mgr, model, opt, i)
        torch.save(snapshot(model, opt, mgr.rank), args.out / f"{'resumed' if args.phase == 'resume' else 'loaded'}"
                                                            f"-rank{mgr.rank}.pt")
    mgr.barrier()
sys.exit(0)
