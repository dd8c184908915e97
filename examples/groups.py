"""Process groups: the collectives of the world, on a subset of ranks. The same file runs under every launcher:

    mpiexec -n 4 python examples/groups.py
    torchrun --standalone --nproc_per_node 4 examples/groups.py
    unidist launch -n 4 --backend horovod examples/groups.py

Every rank calls ``split``/``new_group`` (MPI_Comm_split semantics); roots and peers are group ranks. Each
result is checked against its closed form, so a broken backend makes this script fail, not just print.
"""

from __future__ import annotations

import sys

import torch

import unidist


def main() -> int:
    with unidist.init() as mgr:
        n, r = mgr.size, mgr.rank
        checks: dict[str, bool] = {}

        # even and odd world ranks form two groups; each reduces only its own members' values
        halves = mgr.split(r % 2)
        assert halves is not None  # every rank passed a color
        mine = [w for w in range(n) if w % 2 == r % 2]
        checks["split"] = halves.ranks == tuple(mine) and halves.size == len(mine)
        checks["group allreduce"] = halves.allreduce(torch.tensor([float(r)])).item() == sum(mine)

        # members get a Group, the ranks in between None
        first_last = sorted({0, n - 1})
        ends = mgr.new_group(first_last)
        checks["new_group"] = (ends is not None) == (r in first_last)
        if ends is not None:
            checks["new_group gather"] = ends.allgather(torch.tensor([r])).tolist() == first_last

        # a key orders the group: here backwards, so group rank 0 is world rank n-1
        backwards = mgr.split(0, key=-r)
        assert backwards is not None
        checks["key order"] = backwards.broadcast(torch.tensor([r]), root=0).item() == n - 1

        # data parallel inside each half: two models, trained side by side on their own data
        torch.manual_seed(r % 2)
        model = torch.nn.Linear(4, 1)
        model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), group=halves)
        for step in range(3):
            x = mgr.to_device(torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * r + step)))
            mgr.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
            opt.step()
            opt.zero_grad()
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        checks["data parallel per group"] = torch.equal(halves.allreduce(w, "max"), halves.allreduce(w, "min"))

        bad = [name for name, ok in checks.items() if not ok]
        wrong = int(mgr.allreduce(torch.tensor([len(bad)])).item())
        if mgr.is_main:
            print(f"[rank 0] groups: {'all' if wrong == 0 else wrong} checks {'correct' if wrong == 0 else 'WRONG'} "
                  f"on {n} process(es); halves {halves.ranks} and the rest, ends {ends.ranks if ends else None}",
                  flush=True)
        if bad:
            print(f"[rank {r}] WRONG: {', '.join(bad)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
