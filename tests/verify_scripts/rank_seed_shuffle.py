"""Planted divergence for ``unidist verify``: the data shuffled with a seed that depends on the rank.

Otherwise correct (mgr.prepare, each rank its share of a global batch of fixed size via mgr.shard), but the
permutation of the data set is seeded ``seed + mgr.rank``, so on 2 ranks rank 1's share of step 1 comes from
another order than the one-process run's. Expected: any 2-rank launch diverges at step 1 (the loss first); the
rows agree and their digest does not, so the data-order cause is named.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812

import unidist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across the ranks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(unidist.script_args())
    torch.set_num_threads(1)
    with unidist.init() as mgr:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = (x @ torch.randn(8, 4, generator=g)).argmax(1)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        model, opt = mgr.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        mine = list(mgr.shard(args.batch, shuffle=False))
        # the planted bug: every rank shuffles the data set with its own seed
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed + mgr.rank))
        for s in range(args.steps):
            rows = order[s * args.batch:(s + 1) * args.batch][mine]
            xb, yb = mgr.to_device((x[rows], y[rows]))
            loss = F.cross_entropy(model(xb), yb)
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
        if mgr.is_main:
            print(f"rank_seed_shuffle: ranks={mgr.size} last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
