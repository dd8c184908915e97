"""Save under one launcher, resume under another: the resumed run must end where one uninterrupted process does.

    --phase save:    prepare at --stage, train steps [0, 3), save (SGD and Adam, each in its own directory,
                     with the step and the StepLR state in ``extra``); with --crash-at POINT a second save at
                     step 5 is killed (SIGKILL, this process) at that point inside save_checkpoint.
    --phase resume:  prepare at --stage, load the newest checkpoint, train to step 8, compare with one process
                     trained 8 steps on the whole batch; writes ``<out>/rank<R>.json``.
The batch of a step depends only on the step (not on the world size): rank r of N takes rows [rB/N, (r+1)B/N).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

import unidist
import unidist.checkpoint as ckpt
import unidist.checkpoint.files as ckfiles

STEPS, SAVE_AT, BATCH, DIMS = 8, 3, 12, (64, 256, 96, 8)
OPTS = ("sgd", "adam")


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    a, b, c, d = DIMS
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh(), torch.nn.Linear(b, c), torch.nn.Tanh(),
                               torch.nn.Linear(c, d))


def make_opt(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, DIMS[0], generator=g) * 3, torch.randn(BATCH, DIMS[-1], generator=g) * 10


def train(mgr: Any, model: Any, opt: Any, sched: Any, steps: range) -> None:
    per = BATCH // mgr.size
    rows = slice(mgr.rank * per, (mgr.rank + 1) * per)
    for step in steps:
        x, y = batch(step)
        mgr.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
        opt.step()
        opt.zero_grad()
        sched.step()


def reference(name: str) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = make_opt(name, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model.state_dict()


def arm(point: str) -> None:
    """SIGKILL this process at ``point`` of the next save_checkpoint (as a crash or an OOM kill would)."""
    def die(*_: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def after(fn: Any, calls: int = 1) -> Any:
        count = [0]

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            count[0] += 1
            if count[0] >= calls:
                die()
            return out
        return wrapped
    if point == "shard":  # a shard file written, the rest not
        ckpt.save_tensors = after(ckpt.save_tensors)  # type: ignore[assignment]
    elif point == "manifest":  # everything written and fsynced, not yet renamed into place
        ckfiles.fsync_dir = after(ckfiles.fsync_dir)  # type: ignore[assignment]
    elif point == "swap":  # the old checkpoint moved aside, the new one not yet in its place
        ckfiles.os.replace = after(ckfiles.os.replace)  # type: ignore[assignment]
    elif point == "retention":  # the new checkpoint published, old ones being deleted
        ckfiles.shutil.rmtree = after(ckfiles.shutil.rmtree)  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown crash point {point}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--crash-at", default=None)
    parser.add_argument("--in-place", action="store_true", help="the crashed save overwrites the first one")
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        report: dict[str, Any] = {"backend": mgr.backend, "size": mgr.size}
        for name in OPTS:
            model = make_model()
            model, opt = mgr.prepare(model, make_opt(name, model), zero_stage=ns.stage)
            sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
            where = ns.dir / name
            if ns.phase == "save":
                train(mgr, model, opt, sched, range(SAVE_AT))
                mgr.save_checkpoint(where / f"step-{SAVE_AT}", model, opt, keep=2, step=SAVE_AT,
                                    scheduler=sched.state_dict())
                if ns.crash_at and name == OPTS[-1]:
                    train(mgr, model, opt, sched, range(SAVE_AT, 5))
                    arm(ns.crash_at)
                    target = where / f"step-{SAVE_AT}" if ns.in_place else where / "step-5"
                    mgr.save_checkpoint(target, model, opt, keep=1, step=5, scheduler=sched.state_dict())
                    return 5  # not reached: the save above kills this process
                continue
            latest = mgr.latest_checkpoint(where)
            extra = mgr.load_checkpoint(latest, model, opt)
            sched.load_state_dict(extra["scheduler"])
            train(mgr, model, opt, sched, range(extra["step"], STEPS))
            full = mgr.full_state_dict(model)
            want = reference(name)
            flat = torch.cat([t.reshape(-1) for t in full.values()])
            report[name] = {"resumed_from": extra["step"], "checkpoint": latest.name if latest else None,
                            "diff": max(float((full[k] - v).abs().max()) for k, v in want.items()),
                            "spread": float((mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max())}
        if ns.out is not None:
            (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
