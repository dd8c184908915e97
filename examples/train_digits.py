"""Train a small MLP on scikit-learn's handwritten digits (shipped with scikit-learn: no download).

The same file under every launcher, for example:

    python examples/train_digits.py
    unidist launch -n 2 examples/train_digits.py
    torchrun --standalone --nproc_per_node 2 examples/train_digits.py --zero-stage 3
    deepspeed --num_gpus 2 --no_local_rank examples/train_digits.py --zero-stage 2

Each rank trains on its shard of every batch; ``mgr.prepare`` averages gradients (or builds the DeepSpeed
engine), so the model is the one a single process would train on the whole batch. ``--zero-stage k``
shards optimizer state (1), gradients (2) and parameters (3) across the ranks on every backend.

The data of a step depends only on the global step and the global batch, never on the world size, so a run
checkpointed with ``--checkpoint-dir D --checkpoint-every K`` resumes from the newest checkpoint in D when
restarted, under any launcher, world size and ZeRO stage, and ends with the weights of an uninterrupted run.
With ``--checkpoint-dir`` it also handles preemption (``mgr.preemption()``): on SIGUSR1 (``sbatch
--signal=USR1@120``) or SIGTERM (preemption, ``scancel``) to any rank, every rank saves the current step and the
script exits 0; with ``--requeue`` a Slurm batch job warned of its time limit (SIGUSR1) puts itself back in the
queue (``sbatch --requeue``); SIGTERM is a cancellation, or a preemption Slurm requeues by itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

import unidist


def load(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order].astype(np.float32) / 16.0, y[order]
    cut = int(0.8 * len(y))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 0.1
    x = (x - mean) / std
    return (torch.from_numpy(x[:cut]), torch.from_numpy(y[:cut]), torch.from_numpy(x[cut:]),
            torch.from_numpy(y[cut:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=48, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage 0-3, on every backend")
    parser.add_argument("--backend", default=None, help="override the detected backend (UNIDIST_BACKEND)")
    parser.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--save-weights", default=None, help="write the final full state dict here (rank 0)")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="for testing resume: the last rank kills itself (SIGKILL) at this step, once")
    parser.add_argument("--requeue", action="store_true",
                        help="with --checkpoint-dir: after saving on SIGUSR1 (the time-limit warning), requeue the "
                             "Slurm job (needs sbatch --requeue)")
    parser.add_argument("--signal-at-step", type=int, default=None,
                        help="for testing preemption: the last rank sends itself SIGUSR1 at this step")
    parser.add_argument("--plot", default=None, help="write the loss/accuracy curve to this PNG")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(unidist.script_args())

    with unidist.init(backend=args.backend) as mgr:
        if args.batch_size % mgr.size:
            parser.error(f"--batch-size {args.batch_size} must be divisible by the {mgr.size} ranks")
        torch.manual_seed(args.seed)
        x_train, y_train, x_test, y_test = load(args.seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 10))
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        prepare_opts = {} if args.zero_stage is None else {"zero_stage": args.zero_stage}
        model, opt = mgr.prepare(model, opt, **prepare_opts)
        per_rank = args.batch_size // mgr.size
        steps_per_epoch = len(y_train) // args.batch_size
        test_part = list(mgr.shard(len(y_test), shuffle=False))  # every rank scores its part of the test set

        def evaluate() -> float:
            model.eval()
            with torch.no_grad():
                logits = model(mgr.to_device(x_test[test_part]))
                correct = (logits.argmax(1).cpu() == y_test[test_part]).float().mean().item()
            model.train()
            return mgr.mean(correct)

        step = 0  # the global step: with the global batch it decides the data, whatever the world size
        latest = mgr.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
        if latest is not None:
            step = mgr.load_checkpoint(latest, model, opt)["step"]
            if mgr.is_main:
                print(f"resumed from {latest} at step {step}", flush=True)

        # SIGUSR1/SIGTERM noted; stop.requested() (one tiny allreduce a step) stops every rank at the same step
        stop = mgr.preemption() if args.checkpoint_dir else None
        history: list[tuple[float, float]] = []
        samples, started = 0, time.perf_counter()
        progress = _progress(args.epochs, mgr.is_main)
        for epoch in range(step // steps_per_epoch, args.epochs):
            order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
            losses = []
            for s in range(step - epoch * steps_per_epoch, steps_per_epoch):
                global_batch = order[s * args.batch_size:(s + 1) * args.batch_size]
                rows = global_batch[mgr.rank * per_rank:(mgr.rank + 1) * per_rank]  # this rank's share
                xb, yb = mgr.to_device((x_train[rows], y_train[rows]))  # this rank's device (a GPU if there is one)
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                mgr.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                samples += args.batch_size
                step += 1
                saved = None
                if args.checkpoint_dir and step % args.checkpoint_every == 0:
                    saved = mgr.save_checkpoint(Path(args.checkpoint_dir) / f"step-{step:06d}", model, opt, keep=2,
                                                step=step)
                if step == args.crash_at_step and mgr.rank == mgr.size - 1:
                    _crash_once(Path(args.checkpoint_dir or "."))
                if step == args.signal_at_step and mgr.rank == mgr.size - 1:
                    os.kill(os.getpid(), signal.SIGUSR1)
                if stop is not None and stop.requested():  # every rank, at the same step
                    if saved is None:
                        saved = mgr.save_checkpoint(Path(args.checkpoint_dir) / f"step-{step:06d}", model, opt,
                                                    keep=2, step=step)
                    if mgr.is_main:
                        print(f"preempted by {stop.signal} at step {step}: checkpoint saved to {saved}", flush=True)
                    # stop.signal is the same on every rank here (requeue() is a collective)
                    if args.requeue and stop.signal == "SIGUSR1" and stop.requeue() and mgr.is_main:
                        print("requeued: the job resumes from this checkpoint when it starts again", flush=True)
                    return 0
            history.append((mgr.mean(float(np.mean(losses)) if losses else 0.0), evaluate()))
            progress(f"epoch {epoch + 1}/{args.epochs} loss {history[-1][0]:.4f} test accuracy {history[-1][1]:.4f}")
        elapsed = time.perf_counter() - started
        if not history:  # resumed from a checkpoint of the last step: nothing left to train
            history.append((float("nan"), evaluate()))

        # the whole model as one process would hold it (ZeRO-3 gathers it), compared across ranks
        full = mgr.full_state_dict(model)
        params = torch.cat([t.reshape(-1).float().cpu() for t in full.values()])
        spread = (mgr.allreduce(params, "max") - mgr.allreduce(params, "min")).abs().max().item()
        mem = mgr.memory_stats()
        if mgr.is_main:
            print(f"backend={mgr.backend} ranks={mgr.size} final test accuracy {history[-1][1]:.4f} "
                  f"loss {history[-1][0]:.4f} | {samples / elapsed:.0f} samples/s | "
                  f"max parameter difference across ranks {spread:g} | rank 0 holds "
                  f"{mem['param_bytes']} parameter and {mem['optimizer_bytes']} optimizer-state bytes", flush=True)
            if args.save_weights:
                torch.save(full, args.save_weights)
            if args.plot:
                _plot(history, args.plot)
        return 0 if spread == 0.0 else 1


def _crash_once(directory: Path) -> None:
    """Die as a killed rank would (no cleanup, no exception), unless this run already did: a restarted job
    must get past the step."""
    marker = directory / ".crashed-once"
    if marker.exists():
        return
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)


def _progress(epochs: int, show: bool):  # type: ignore[no-untyped-def]
    """A tqdm bar on rank 0 only; plain lines when tqdm is missing or output is not a terminal."""
    bar = None
    if show and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=epochs, unit="epoch")
        except ImportError:
            pass

    def report(text: str) -> None:
        if bar is not None:
            bar.set_description(text)
            bar.update(1)
        elif show:
            print(text, flush=True)
    return report


def _plot(history: list[tuple[float, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    epochs = range(1, len(history) + 1)
    ax.plot(epochs, [h[0] for h in history], color="tab:blue", label="train loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(epochs, [h[1] for h in history], color="tab:orange", label="test accuracy")
    ax2.set_ylabel("test accuracy", color="tab:orange")
    ax.set_title("unidist: digits MLP")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
