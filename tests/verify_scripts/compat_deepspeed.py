"""A DeepSpeed training loop (only the import differs from DeepSpeed's), for ``unidist verify``.

The config fixes the global batch (train_batch_size) and the accumulation steps; DeepSpeed derives the micro
batch per rank from the world size. Each optimizer step's global batch is cut into world x accumulation equal
micro-batches, so the averaged gradient is the one-process run's whatever the world size. Also exercised: the
config's optimizer section, gradient clipping (its default 1.0 here, on every launch alike), engine.backward and
engine.step at and between accumulation boundaries. Synthetic data (no download), CPU, about a second.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812

import unidist.compat.deepspeed as deepspeed

CONFIG = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "gradient_clipping": 0.5,
}


def data(n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x @ torch.randn(8, 4, generator=g)).argmax(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=-1)  # what the deepspeed launcher appends
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = data()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                           config=CONFIG)
    world, rank = engine.world_size, engine.global_rank
    mb, gas, global_batch = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                             engine.train_batch_size())
    assert mb * gas * world == global_batch == CONFIG["train_batch_size"], (mb, gas, world)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    for s in range(args.steps):
        batch = order[s * global_batch:(s + 1) * global_batch]
        for m in range(gas):
            part = (m * world + rank) * mb
            rows = batch[part:part + mb]
            loss = F.cross_entropy(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
    if rank == 0:
        print(f"compat_deepspeed: world={world} micro={mb} steps={engine.global_steps} last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
