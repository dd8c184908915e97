"""Hybrid parallelism on 4 ranks: 2-way tensor parallel inside each pair of ranks, 2-way data parallel across
the pairs. The same file runs under every launcher that starts 4 processes:

    mpiexec -n 4 python examples/hybrid_mlp.py
    torchrun --standalone --nproc_per_node 4 examples/hybrid_mlp.py
    unidist launch -n 4 examples/hybrid_mlp.py

Layout (world ranks):    tensor-parallel groups {0, 1} and {2, 3}   (split(rank // 2))
                         data-parallel groups   {0, 2} and {1, 3}   (split(rank % 2))
Each pair holds one replica of an MLP whose first layer is split by output features (ColumnParallelLinear)
and second by input features (RowParallelLinear); each replica trains on its half of every batch, and
``prepare(..., group=dp)`` averages gradients over the ranks holding the same shard. Every rank also trains
the dense MLP on the whole batch in-process and checks that its shard follows the dense weights: the script
fails (exit 1) if they differ by more than 1e-5.
"""

from __future__ import annotations

import argparse
import sys

import torch

import unidist
from unidist.parallel import ColumnParallelLinear, RowParallelLinear

IN, HIDDEN, OUT, BATCH = 16, 64, 4, 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher adds it
    args = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        if mgr.size != 4:
            print(f"hybrid_mlp.py needs 4 processes (2-way tensor x 2-way data parallel), got {mgr.size}",
                  file=sys.stderr)
            return 2
        tp, dp = mgr.split(mgr.rank // 2), mgr.split(mgr.rank % 2)

        torch.manual_seed(0)  # the same dense model on every rank: the reference, and the source of the shards
        dense = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))
        model = torch.nn.Sequential(ColumnParallelLinear.from_dense(dense[0], tp, gather_output=False),
                                    torch.nn.GELU(),
                                    RowParallelLinear.from_dense(dense[2], tp, input_is_parallel=True))
        model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), group=dp)
        dense = dense.to(mgr.device)  # the reference beside the shards, on this rank's device (a GPU if there is one)
        dense_opt = torch.optim.SGD(dense.parameters(), lr=0.05, momentum=0.9)

        gen = torch.Generator().manual_seed(1)
        rows = slice(dp.rank * BATCH // 2, (dp.rank + 1) * BATCH // 2)  # this replica's half of each batch
        for step in range(args.steps):
            x, y = torch.randn(BATCH, IN, generator=gen) * 2, torch.randn(BATCH, OUT, generator=gen) * 10
            x, y = mgr.to_device((x, y))
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
            dense_loss = torch.nn.functional.mse_loss(dense(x), y)
            dense_loss.backward()
            dense_opt.step()
            dense_opt.zero_grad()
            mean_loss = mgr.allreduce(loss.detach().reshape(1), op="mean").item()
            if mgr.rank == 0:
                print(f"step {step}: loss {mean_loss:.4f} (dense model, whole batch: {dense_loss.item():.4f})",
                      flush=True)

        shard = slice(tp.rank * HIDDEN // 2, (tp.rank + 1) * HIDDEN // 2)
        col, row = model[0], model[2]
        pairs = [(col.weight, dense[0].weight[shard]), (col.bias, dense[0].bias[shard]),
                 (row.weight, dense[2].weight[:, shard]), (row.bias, dense[2].bias)]
        diff = max((a.detach() - b.detach()).abs().max().item() for a, b in pairs)
        worst = mgr.allreduce(torch.tensor([diff]), op="max").item()
        if mgr.rank == 0:
            print(f"max |hybrid - dense| over every rank's shards after {args.steps} steps: {worst:.2e}")
        return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
