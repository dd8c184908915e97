"""A Horovod training loop (only the import differs from Horovod's), for ``unidist verify``.

hvd.init(), broadcast_parameters from rank 0, DistributedOptimizer with named parameters; every rank trains on
its contiguous share of a global batch of fixed size, so the model is the one a single process would train on
the whole batch, at any hvd.size(). Synthetic data (no download), CPU, about a second.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812  (as Horovod's examples spell it)

import unidist.compat.horovod as hvd


def data(n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x @ torch.randn(8, 4, generator=g)).argmax(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across the ranks")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = data()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    per = args.batch // hvd.size()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    for s in range(args.steps):
        batch = order[s * args.batch:(s + 1) * args.batch]
        rows = batch[hvd.rank() * per:(hvd.rank() + 1) * per]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    if hvd.rank() == 0:
        print(f"compat_horovod: size={hvd.size()} steps={args.steps} last loss {loss.item():.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
