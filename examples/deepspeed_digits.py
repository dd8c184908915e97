"""A DeepSpeed training script, as DeepSpeed users write them, run by unidist: only the import line differs.

    import unidist.compat.deepspeed as deepspeed      # was: import deepspeed

It follows DeepSpeedExamples' CIFAR-10 script (add_config_arguments, init_distributed, initialize with the JSON
config and the training set, engine.backward / engine.step, the accelerator's device name, save_checkpoint with a
client_state and load_checkpoint to resume) on scikit-learn's bundled digits (no download). The config
(deepspeed_digits.json) has ZeRO stage 2, two accumulation steps, Adam with weight decay, a warm-up and
DeepSpeed's clipping at norm 1.0: the same math as real DeepSpeed on every launcher (python, mpiexec, torchrun,
horovodrun and the deepspeed launcher, which appends --local_rank=N, declared below as DeepSpeed scripts do).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import unidist.compat.deepspeed as deepspeed
from unidist.compat.deepspeed.accelerator import get_accelerator


def load(train: bool) -> torch.utils.data.TensorDataset:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order].astype(np.float32) / 16.0, y[order]
    cut = int(0.8 * len(y))
    x = (x - x[:cut].mean(0)) / (x[:cut].std(0) + 0.1)
    part = slice(0, cut) if train else slice(cut, None)
    return torch.utils.data.TensorDataset(torch.from_numpy(x[part]), torch.from_numpy(y[part]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--checkpoint-dir", default=None, help="save after every epoch; resume from its latest")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=load(True))
    device = get_accelerator().device_name(engine.local_rank)
    start = 0
    if args.checkpoint_dir is not None:
        _, client_state = engine.load_checkpoint(args.checkpoint_dir)
        start = client_state["epoch"] if client_state else 0
    for epoch in range(start, args.epochs):
        engine.train()
        for data, target in loader:
            loss = F.cross_entropy(engine(data.to(device)), target.to(device))
            engine.backward(loss)
            engine.step()
        if args.checkpoint_dir is not None:
            engine.save_checkpoint(args.checkpoint_dir, client_state={"epoch": epoch + 1})
    engine.eval()
    test = load(False)
    mine = range(dist.get_rank(), len(test), dist.get_world_size())
    with torch.no_grad():
        data, target = test[list(mine)]
        counts = torch.tensor([float((engine(data.to(device)).argmax(1) == target.to(device)).sum()), len(mine)])
    dist.all_reduce(counts)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # whole even under ZeRO-3
        weights = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    low, high = weights.clone(), weights.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"deepspeed_digits: size={dist.get_world_size()} steps={engine.global_steps} "
              f"test accuracy {float(counts[0] / counts[1]):.4f} max parameter difference across ranks "
              f"{float((high - low).abs().max())}")


if __name__ == "__main__":
    main()
