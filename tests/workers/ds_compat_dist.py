"""deepspeed.init_distributed + deepspeed.comm under any launcher (tests/multiproc/test_ds_compat_dist.py).

``--impl compat`` (unidist.compat.deepspeed): calls ``init_distributed`` as a DeepSpeed script does (no unidist
call of its own: the Manager starts inside it and everything ends at exit, through the atexit hooks), then
records DeepSpeed's five variables before and after, torch.distributed's view (rank, world, an all_reduce, a
barrier), unidist's Manager's ranks, and for every deepspeed.comm case the max |got - numpy| over this rank's
result with its scale. Each rank's inputs come from a generator seeded by its rank, so every rank computes
every other rank's inputs and the numpy reference locally.

``--impl deepspeed`` (real DeepSpeed, under mpiexec only): ``deepspeed.init_distributed`` and the variables it
set, for the test to compare with compat's.

Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ROWS = 3  # rows of each rank's slice in the gather/scatter cases


def inputs(rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s inputs: activations/gradients at realistic magnitudes, integers for the bitwise ops."""
    g = np.random.default_rng(100 + rank)
    return {"f": (g.normal(0.0, 30.0, size=(4, 6))).astype(np.float32),
            "near1": (1.0 + 0.1 * g.normal(size=(4, 6))).astype(np.float32),
            "i": g.integers(0, 2**20, size=(4, 6), dtype=np.int64),
            "rows": g.normal(0.0, 5.0, size=(ROWS, 5)).astype(np.float32)}


def cases(comm: Any, rank: int, size: int) -> dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]]:
    """Case name -> a call returning (got, numpy's want) for this rank."""
    mine, every = inputs(rank), [inputs(r) for r in range(size)]
    op = comm.ReduceOp
    reductions = {"SUM": ("f", np.sum), "PRODUCT": ("near1", np.prod), "MIN": ("f", np.min), "MAX": ("f", np.max),
                  "AVG": ("f", np.mean), "BAND": ("i", np.bitwise_and.reduce), "BOR": ("i", np.bitwise_or.reduce),
                  "BXOR": ("i", np.bitwise_xor.reduce)}
    table: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = {}

    def reduce_case(name: str, key: str, fn: Any) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        def run() -> tuple[np.ndarray, np.ndarray]:
            t = torch.from_numpy(mine[key].copy())
            comm.all_reduce(t, op=op[name])
            return t.numpy(), fn(np.stack([e[key] for e in every]), axis=0)
        return run

    for name, (key, fn) in reductions.items():
        table[f"all_reduce/{name}"] = reduce_case(name, key, fn)

    def async_sum() -> tuple[np.ndarray, np.ndarray]:
        t = torch.from_numpy(mine["f"].copy())
        comm.all_reduce(t, async_op=True).wait()
        return t.numpy(), np.sum([e["f"] for e in every], axis=0)

    def all_gather() -> tuple[np.ndarray, np.ndarray]:
        out = [torch.empty(ROWS, 5) for _ in range(size)]
        comm.all_gather(out, torch.from_numpy(mine["rows"]))
        return torch.stack(out).numpy(), np.stack([e["rows"] for e in every])

    def all_gather_into_tensor() -> tuple[np.ndarray, np.ndarray]:
        out = torch.empty(size * ROWS, 5)
        comm.all_gather_into_tensor(out, torch.from_numpy(mine["rows"]))
        return out.numpy(), np.concatenate([e["rows"] for e in every])

    def reduce_scatter_tensor(name: str) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        def run() -> tuple[np.ndarray, np.ndarray]:
            full = [np.tile(e["rows"], (size, 1)) * (1 + np.arange(size * ROWS)[:, None]) for e in every]
            out = torch.empty(ROWS, 5)
            comm.reduce_scatter_tensor(out, torch.from_numpy(full[rank].astype(np.float32)), op=op[name])
            fn = np.sum if name == "SUM" else np.max
            return out.numpy(), fn(np.stack(full), axis=0)[rank * ROWS:(rank + 1) * ROWS]
        return run

    def broadcast() -> tuple[np.ndarray, np.ndarray]:
        t = torch.from_numpy(mine["f"].copy())
        comm.broadcast(t, src=size - 1)
        return t.numpy(), every[size - 1]["f"]

    def subgroup() -> tuple[np.ndarray, np.ndarray]:
        # every rank makes both groups (torch's rule); the even ranks sum among themselves
        evens = comm.new_group(list(range(0, size, 2)))
        comm.new_group(list(range(1, size, 2)) or [0])
        t = torch.from_numpy(mine["f"].copy())
        if rank % 2 == 0:
            comm.all_reduce(t, group=evens)
            want = np.sum([every[r]["f"] for r in range(0, size, 2)], axis=0)
            got = np.concatenate([t.numpy().ravel(), [comm.get_global_rank(evens, len(range(0, size, 2)) - 1),
                                                      comm.get_world_size(evens)]])
            return got, np.concatenate([want.ravel(), [2 * (len(range(0, size, 2)) - 1), len(range(0, size, 2))]])
        return t.numpy(), mine["f"]

    def reduce_to_last() -> tuple[np.ndarray, np.ndarray]:
        t = torch.from_numpy(mine["f"].copy())
        comm.reduce(t, dst=size - 1, op=op.MAX)
        if rank != size - 1:  # torch defines the result on dst only (gloo uses the others' tensors as scratch)
            return mine["f"], mine["f"]
        return t.numpy(), np.max([e["f"] for e in every], axis=0)

    def slices(r: int) -> list[np.ndarray]:
        """Rank r's list of one block per rank (block s scaled by s + 1)."""
        return [(every[r]["rows"] * (s + 1)).astype(np.float32) for s in range(size)]

    def reduce_scatter_list() -> tuple[np.ndarray, np.ndarray]:
        out = torch.empty(ROWS, 5)
        comm.reduce_scatter(out, [torch.from_numpy(b) for b in slices(rank)])
        return out.numpy(), np.sum([slices(r)[rank] for r in range(size)], axis=0)

    def all_to_all() -> tuple[np.ndarray, np.ndarray]:
        out = [torch.empty(ROWS, 5) for _ in range(size)]
        comm.all_to_all(out, [torch.from_numpy(b) for b in slices(rank)])
        return torch.stack(out).numpy(), np.stack([slices(r)[rank] for r in range(size)])

    def all_to_all_single() -> tuple[np.ndarray, np.ndarray]:
        out = torch.empty(size * ROWS, 5)
        comm.all_to_all_single(out, torch.from_numpy(np.concatenate(slices(rank))))
        return out.numpy(), np.concatenate([slices(r)[rank] for r in range(size)])

    def gather() -> tuple[np.ndarray, np.ndarray]:
        dst = size - 1
        out = [torch.empty(ROWS, 5) for _ in range(size)] if rank == dst else None
        comm.gather(torch.from_numpy(mine["rows"]), out, dst=dst)
        if out is None:
            return mine["rows"], mine["rows"]
        return torch.stack(out).numpy(), np.stack([e["rows"] for e in every])

    def scatter() -> tuple[np.ndarray, np.ndarray]:
        out = torch.empty(ROWS, 5)
        comm.scatter(out, [torch.from_numpy(b) for b in slices(0)] if rank == 0 else None, src=0)
        comm.monitored_barrier()
        return out.numpy(), slices(0)[rank]

    table.update({"reduce/MAX": reduce_to_last, "reduce_scatter": reduce_scatter_list, "all_to_all": all_to_all,
                  "all_to_all_single": all_to_all_single, "gather": gather, "scatter": scatter})
    table.update({"all_reduce/async": async_sum, "all_gather": all_gather,
                  "all_gather_into_tensor": all_gather_into_tensor,
                  "reduce_scatter_tensor/SUM": reduce_scatter_tensor("SUM"),
                  "reduce_scatter_tensor/MAX": reduce_scatter_tensor("MAX"), "broadcast": broadcast,
                  "new_group": subgroup})
    return table


def run_compat(report: dict[str, Any]) -> int:
    from unidist.compat.deepspeed import comm, state
    from unidist.compat.deepspeed.dist import init_distributed
    from unidist.compat.deepspeed.utils import logger

    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logger.addHandler(Catch(logging.WARNING))
    init_distributed(distributed_port=report["port"])
    init_distributed(distributed_port=report["port"])  # a second call: a no-op
    mgr = state.running()
    dist = torch.distributed
    rank, size = dist.get_rank(), dist.get_world_size()
    total = torch.full((3,), float(rank + 1))
    dist.all_reduce(total)
    dist.barrier()
    report.update(env={n: os.environ.get(n) for n in ENV_NAMES}, warnings=warnings, backend=mgr.backend,
                  mgr=[mgr.rank, mgr.size, mgr.local_rank], torch=[rank, size, total.tolist()],
                  comm=[comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.get_global_rank()])
    objs: list[Any] = [None] * size
    comm.all_gather_object(objs, report["env"])
    report["every_env"] = objs
    results: dict[str, Any] = {}
    for name, case in cases(comm, rank, size).items():
        try:
            got, want = case()
            diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
            results[name] = {"diff": diff, "scale": float(np.max(np.abs(want))), "dtype": str(got.dtype),
                             "shape": list(got.shape), "want_shape": list(want.shape)}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    report["cases"] = results
    return rank


def run_deepspeed(report: dict[str, Any]) -> int:
    import deepspeed

    compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
    if isinstance(compatible, dict):  # skip the shared-memory op's JIT build (see unidist/engines/deepspeed/manager.py)
        compatible["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo", distributed_port=report["port"])
    report["env"] = {n: os.environ.get(n) for n in ENV_NAMES}
    report["torch"] = [torch.distributed.get_rank(), torch.distributed.get_world_size()]
    torch.distributed.barrier()
    rank = torch.distributed.get_rank()
    torch.distributed.destroy_process_group()
    return int(rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--impl", choices=("compat", "deepspeed"), default="compat")
    parser.add_argument("--port", type=int, required=True)
    ns, _ = parser.parse_known_args()  # the deepspeed launcher appends --local_rank=N
    report: dict[str, Any] = {"port": ns.port, "env_before": {n: os.environ.get(n) for n in ENV_NAMES}}
    rank = run_compat(report) if ns.impl == "compat" else run_deepspeed(report)
    (ns.out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
