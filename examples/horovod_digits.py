"""A Horovod training script, as Horovod users write them, run by unidist: only the import line differs.

    import unidist.compat.horovod as hvd      # was: import horovod.torch as hvd

It follows Horovod's PyTorch MNIST example (hvd.init, a DistributedSampler over hvd.size()/hvd.rank(),
broadcast_parameters and broadcast_optimizer_state from rank 0, DistributedOptimizer with named parameters and
optional fp16 compression, metrics averaged with hvd.allreduce) on scikit-learn's bundled digits (no download),
and runs unchanged under python, mpiexec, torchrun, the deepspeed launcher (with --no_local_rank: this parser,
like Horovod's examples, does not declare --local_rank) and horovodrun.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812  (as Horovod's examples spell it)
import torch.utils.data.distributed

import unidist.compat.horovod as hvd


def load(train: bool) -> torch.utils.data.TensorDataset:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order].astype(np.float32) / 16.0, y[order]
    cut = int(0.8 * len(y))
    x = (x - x[:cut].mean(0)) / (x[:cut].std(0) + 0.1)  # standardized with the training rows' statistics
    part = slice(0, cut) if train else slice(cut, None)
    return torch.utils.data.TensorDataset(torch.from_numpy(x[part]), torch.from_numpy(y[part]))


def metric_average(val: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor(val), name=name))  # Average across ranks, Horovod's default op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, as in Horovod's examples")
    parser.add_argument("--lr", type=float, default=0.05, help="scaled by hvd.size(), as in Horovod's examples")
    parser.add_argument("--fp16-allreduce", action="store_true", help="hvd.Compression.fp16")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    train, test = load(True), load(False)
    sampler = torch.utils.data.distributed.DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
    model.eval()
    test_sampler = torch.utils.data.distributed.DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank())
    correct, count = 0.0, 0
    with torch.no_grad():
        for data, target in torch.utils.data.DataLoader(test, batch_size=256, sampler=test_sampler):
            correct += float((model(data).argmax(1) == target).sum())
            count += len(target)
    accuracy = metric_average(correct / count, "avg_accuracy")
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = float((hvd.allreduce(weights, op=hvd.Max) - hvd.allreduce(weights, op=hvd.Min)).abs().max())
    if hvd.rank() == 0:
        print(f"horovod_digits: size={hvd.size()} test accuracy {accuracy:.4f} max parameter difference across "
              f"ranks {spread}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
