"""A tour of unidist's collectives. The same file runs under every launcher:

    python examples/hello_collectives.py
    mpiexec -n 2 python examples/hello_collectives.py
    unidist launch -n 2 examples/hello_collectives.py

Each result is checked against its closed form, so a broken backend makes this script fail, not just print.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import unidist


def main() -> int:
    with unidist.init() as mgr:
        n, r = mgr.size, mgr.rank
        print(f"[rank {r}/{n}] backend={mgr.backend} local_rank={mgr.local_rank} node={mgr.node_rank} "
              f"device={mgr.device}", flush=True)

        x = torch.full((3,), float(r + 1))
        checks = {
            # elementwise reductions: sum (the default), mean, max; torch in, torch out
            "allreduce sum": (mgr.allreduce(x), torch.full((3,), n * (n + 1) / 2)),
            "allreduce mean": (mgr.allreduce(x, op="mean"), torch.full((3,), (n + 1) / 2)),
            "allreduce max": (mgr.allreduce(x, op=unidist.ReduceOp.MAX), torch.full((3,), float(n))),
            # numpy in, numpy out; first dims may differ per rank
            "allgather": (mgr.allgather(np.full(r + 1, r)), np.concatenate([np.full(k + 1, k) for k in range(n)])),
            # root's dim-0 chunks, numpy.array_split sizes
            "scatter": (mgr.scatter(np.arange(10) if mgr.is_main else None), np.array_split(np.arange(10), n)[r]),
            # any picklable object
            "broadcast_object": (mgr.broadcast_object({"lr": 0.1, "from": r}), {"lr": 0.1, "from": 0}),
        }
        handle = mgr.allreduce_async(torch.ones(4))  # overlap: start now, wait later
        checks["allreduce_async"] = (handle.wait(), torch.full((4,), float(n)))

        bad = [name for name, (got, want) in checks.items()
               if not (got == want if isinstance(want, dict) else np.array_equal(np.asarray(got), np.asarray(want)))]
        mgr.barrier()
        if mgr.is_main:
            print(f"[rank 0] {len(checks) - len(bad)}/{len(checks)} collectives correct on {n} process(es): "
                  f"allreduce sum = {checks['allreduce sum'][0].tolist()}", flush=True)
        if bad:
            print(f"[rank {r}] WRONG: {', '.join(bad)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
