"""The reference for examples/train_digits.py: the same model, data, global batch and loop on torch's own
DistributedDataParallel (gloo), under torchrun. Prints samples/s, to set beside train_digits' figure.

    torchrun --standalone --nproc_per_node 2 -m unidist.bench.ddp_digits --epochs 20
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from unidist.bench.machine import line as machine_line


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    from sklearn.datasets import load_digits

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order].astype(np.float32) / 16.0, y[order]
    cut = int(0.8 * len(y))
    x = (x - x[:cut].mean(0)) / (x[:cut].std(0) + 0.1)
    x_train, y_train = torch.from_numpy(x[:cut]), torch.from_numpy(y[:cut])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=2e-3)
    data: Any = range(len(y_train))
    sampler: Any = torch.utils.data.DistributedSampler(data, size, rank, shuffle=True, seed=0, drop_last=True)
    per_rank = args.batch_size // size
    samples, started = 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(sampler))
        for start in range(0, len(idx) - per_rank + 1, per_rank):
            batch = idx[start:start + per_rank]
            loss = torch.nn.functional.cross_entropy(ddp(x_train[batch]), y_train[batch])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            samples += per_rank * size
    elapsed = time.perf_counter() - started
    if rank == 0:
        print(machine_line(), flush=True)
        print(f"ddp(gloo) ranks={size} | {samples / elapsed:.0f} samples/s ({os.environ.get('OMP_NUM_THREADS')} "
              "OMP threads)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
