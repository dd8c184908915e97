"""Planted divergence for ``unidist verify``: every rank trains on the whole global batch (no mgr.shard).

The gradient average of identical gradients is the one-process gradient, so the loss and the parameters even
agree; but the ranks together saw world x the rows a step (the data is read world times, an epoch takes world
times the compute, and any per-rank randomness would train on duplicates). Expected: any 2-rank launch diverges
at step 1 on ``rows``, with the effective-batch cause.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812

import unidist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch (meant to be split across the ranks)")
    args = parser.parse_args(unidist.script_args())
    torch.set_num_threads(1)
    with unidist.init() as mgr:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = (x @ torch.randn(8, 4, generator=g)).argmax(1)
        net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        model, opt = mgr.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
        for s in range(args.steps):
            rows = order[s * args.batch:(s + 1) * args.batch]  # the planted bug: no [list(mgr.shard(batch))]
            xb, yb = mgr.to_device((x[rows], y[rows]))
            loss = F.cross_entropy(model(xb), yb)
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
        if mgr.is_main:
            print(f"no_shard: ranks={mgr.size} last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
