"""An hvd.elastic training job with an injected crash: two models (SGD momentum, Adam) in one TorchState.

Each step trains both models on this rank's batch from an ElasticSampler, averages the gradients over the
ranks (Horovod's DistributedOptimizer's math, written out: allreduce mean) and steps; ``state.commit()``
every ``--commit-every`` steps. With ``--crash-at S`` the rank ``--crash-rank`` calls ``os._exit(1)`` right
after step S, once: it first creates ``--crash-marker``, so the restarted (or re-run) job does not crash.
Every rank appends one JSON line per step to ``<out>/log-rank<R>.jsonl`` (attempt, epoch, step, indices) and
at the end writes ``<out>/rank<R>.json`` (both models' final weights). ``simulate`` is the uninterrupted
reference: one process, plain torch, the same data dealt as the sampler deals it, gradients averaged by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

import unidist
import unidist.compat.horovod as hvd

N, FEATURES, CLASSES, BATCH, EPOCHS, SEED = 64, 6, 3, 4, 3, 0


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(N, FEATURES, generator=gen) * 2.0
    y = torch.randint(0, CLASSES, (N,), generator=gen)
    return x, y


def models() -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    torch.manual_seed(SEED)
    out: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for name in ("sgd", "adam"):
        m = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
        opt: torch.optim.Optimizer = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if name == "sgd"
                                      else torch.optim.Adam(m.parameters(), lr=0.01))
        out[name] = (m, opt)
    return out


def local_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def simulate(size: int, switch_at: int = 0, new_size: int = 0) -> dict[str, dict[str, list[Any]]]:
    """Final weights of an uninterrupted run on ``size`` ranks, in one process: per step each rank's gradient on
    its own batch, summed over ranks and divided by the rank count. With ``switch_at``, the job continues on
    ``new_size`` ranks after that step, the rest of the epoch dealt again as ElasticSampler deals it (Horovod's
    order, padding and round robin, written out here); the partial last batch of a rank's share is dropped."""
    x, y = data()
    out = {}
    for name, (model, opt) in models().items():
        n, step = size, 0
        for epoch in range(EPOCHS):
            order = list(range(N))
            random.Random(SEED + epoch).shuffle(order)
            done = 0
            while True:
                rest = order[done:]
                per = -(-len(rest) // n)
                padded = rest + rest[:per * n - len(rest)]
                shares = [padded[r::n] for r in range(n)]
                switched = False
                for b in range(per // BATCH):
                    grads: list[list[torch.Tensor]] = []
                    for r in range(n):
                        idx = shares[r][b * BATCH:(b + 1) * BATCH]
                        local_step(model, x[idx], y[idx])
                        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
                    for i, p in enumerate(model.parameters()):
                        total = grads[0][i].clone()
                        for g in grads[1:]:
                            total += g[i]
                        p.grad = total / n
                    opt.step()
                    done, step = done + BATCH * n, step + 1
                    if step == switch_at and n != new_size:
                        n, switched = new_size, True
                        break
                if not switched:
                    break
        out[name] = {k: v.tolist() for k, v in model.state_dict().items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit-every", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=0)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--crash-marker", type=Path)
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        x, y = data()
        built = models()
        (sgd, sgd_opt), (adam, adam_opt) = built["sgd"], built["adam"]
        sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=SEED)
        state = hvd.elastic.TorchState(sgd, sgd_opt, adam_model=adam, adam_optimizer=adam_opt, sampler=sampler,
                                       epoch=0, step=0)
        resets: list[int] = []
        state.register_reset_callbacks([lambda: resets.append(mgr.size)])
        log = (ns.out / f"log-rank{mgr.rank}.jsonl").open("a")
        commit_seconds: list[float] = []

        @hvd.elastic.run
        def train(state: Any) -> None:
            for state.epoch in range(state.epoch, EPOCHS):  # noqa: B020 (Horovod's idiom: the loop commits it)
                order = list(iter(state.sampler))
                for b in range(len(order) // BATCH):
                    idx = order[b * BATCH:(b + 1) * BATCH]
                    for model, opt in ((state.model, state.optimizer), (state.adam_model, state.adam_optimizer)):
                        local_step(model, x[idx], y[idx])
                        for p in model.parameters():
                            mgr.allreduce_(p.grad, op="mean")
                        opt.step()
                    state.sampler.record_batch(b, BATCH)
                    state.step += 1
                    log.write(json.dumps({"attempt": mgr.launch.attempt, "pid": os.getpid(), "epoch": state.epoch,
                                          "step": state.step, "indices": idx}) + "\n")
                    log.flush()
                    if state.step == ns.crash_at and mgr.rank == ns.crash_rank and ns.crash_marker is not None \
                            and not ns.crash_marker.exists():
                        ns.crash_marker.touch()
                        print(f"worker: rank {mgr.rank} crashes after step {state.step}", flush=True)
                        os._exit(1)
                    if state.step % ns.commit_every == 0:
                        t = time.perf_counter()
                        state.commit()
                        commit_seconds.append(time.perf_counter() - t)
                state.sampler.set_epoch(state.epoch + 1)

        train(state)
        report = {"backend": mgr.backend, "size": mgr.size, "attempt": mgr.launch.attempt, "resets": resets,
                  "steps": state.step, "commit_seconds": commit_seconds,
                  "weights": {"sgd": {k: v.tolist() for k, v in sgd.state_dict().items()},
                              "adam": {k: v.tolist() for k, v in adam.state_dict().items()}}}
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
