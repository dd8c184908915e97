"""A launch that fails, for ``unidist verify``: rank 1 raises at step 2 (one process, rank 0 only, runs through).

Expected: the one-process run writes its fingerprint, the 2-rank launch exits non-zero, verify exits 2 and shows
the launch's output tail with this error's text.
"""

from __future__ import annotations

import torch

import unidist

MESSAGE = "planted failure on rank 1 at step 2"


def main() -> None:
    torch.set_num_threads(1)
    with unidist.init() as mgr:
        torch.manual_seed(0)
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        net = torch.nn.Linear(8, 1)
        model, opt = mgr.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        mine = list(mgr.shard(8, shuffle=False))
        for s in range(4):
            if s == 1 and mgr.rank == 1:
                raise RuntimeError(MESSAGE)
            xb = mgr.to_device(x[s * 8:(s + 1) * 8][mine])
            mgr.backward(model(xb).pow(2).mean())
            opt.step()
            opt.zero_grad()


if __name__ == "__main__":
    main()
