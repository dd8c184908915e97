"""An elastic Horovod training script, as Horovod users write them, run by unidist: only the import line differs.

    import unidist.compat.horovod as hvd      # was: import horovod.torch as hvd

It follows Horovod's elastic PyTorch examples (examples/elastic/pytorch/ in horovod/horovod): a TorchState holding
the model, the optimizer, an ElasticSampler, the epoch and the batch, a training function under
``@hvd.elastic.run`` that calls ``state.commit()`` every ``--batches-per-commit`` batches (each commit is written
to disk here), and a reset callback that rescales the learning rate by the new ``hvd.size()``; on scikit-learn's
bundled digits (no download).

Horovod re-forms the world inside the running processes; unidist's launchers cannot, so a lost rank ends the job
and the same command run again (at any number of processes, under any launcher) resumes from the last written
commit: ``--lose-rank R --lose-at-epoch E`` makes rank R kill itself (SIGKILL, as the kernel's out-of-memory
killer would) when epoch E begins, to try it. ``UNIDIST_ELASTIC_JOB`` names the job, so that the run that
resumes may take other arguments.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F  # noqa: N812  (as Horovod's examples spell it)
from horovod_digits import load  # the digits, split and standardized as the plain Horovod example has them

import unidist.compat.horovod as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, as in Horovod's examples")
    parser.add_argument("--lr", type=float, default=0.05, help="scaled by hvd.size(), as in Horovod's examples")
    parser.add_argument("--batches-per-commit", type=int, default=10)
    parser.add_argument("--lose-rank", type=int, default=-1, help="this rank is lost (SIGKILL) ...")
    parser.add_argument("--lose-at-epoch", type=int, default=0, help="... when this epoch begins")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    train_set, test_set = load(True), load(False)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=42)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, args.epochs + 1):  # noqa: B020 (Horovod's idiom: the state keeps it)
            if state.epoch == args.lose_at_epoch and hvd.rank() == args.lose_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            state.model.train()
            loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
            for data, target in loader:
                state.optimizer.zero_grad()
                F.cross_entropy(state.model(data), target).backward()
                state.optimizer.step()
                state.sampler.record_batch(state.batch, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            if hvd.rank() == 0:
                print(f"horovod_elastic: epoch {state.epoch} done on {hvd.size()} rank(s)", flush=True)
            state.sampler.set_epoch(state.epoch + 1)
            state.batch = 0

    def on_state_reset() -> None:  # the world's size may differ after a resume: rescale as Horovod's examples do
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=1, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)

    model.eval()
    with torch.no_grad():
        data, target = test_set.tensors
        accuracy = float((model(data).argmax(1) == target).float().mean())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = float((hvd.allreduce(weights, op=hvd.Max) - hvd.allreduce(weights, op=hvd.Min)).abs().max())
    if hvd.rank() == 0:
        print(f"horovod_elastic: size={hvd.size()} test accuracy {accuracy:.4f} max parameter difference across "
              f"ranks {spread}")


if __name__ == "__main__":
    main()
