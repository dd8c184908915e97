"""Background checkpoints (``save_checkpoint(..., blocking=False)``) under a real launcher.

    --phase run --stage S --dir D --out O [--crashed C]
        train 3 steps; save step 3 synchronously (``sync/``) and in the background (``bg/``); train 2 more steps
        while the background save is written; wait; load both into fresh models: they must be equal, and differ
        from the model trained on. Then a second background save while one is in flight (the first is published
        by the second call), and a last one never waited for (the ``with`` exit publishes it). With ``--crashed
        C``: first load C's latest checkpoint and its synchronous twin ``C/ref`` and compare them.
        Writes ``<out>/rank<R>.json``.
    --phase crash --stage S --dir C
        train 3 steps; save step 3 (background, waited for) and its twin ``ref/`` (synchronous); train 2 steps;
        start a background save of step 5 whose writer is slowed (10 ms per write), and once every rank's
        writer has written part of its shard, SIGKILL this process (mpiexec/torchrun end the others).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import unidist
import unidist.checkpoint.files as ckfiles

BATCH, DIMS = 12, (32, 128, 64, 8)


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    a, b, c, d = DIMS
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh(), torch.nn.Linear(b, c), torch.nn.Tanh(),
                               torch.nn.Linear(c, d))


def prepared(mgr: Any, stage: int) -> tuple[Any, Any]:
    model = make_model()
    return mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), zero_stage=stage)  # type: ignore[no-any-return]


def train(mgr: Any, model: Any, opt: Any, steps: range) -> None:
    per = BATCH // mgr.size
    rows = slice(mgr.rank * per, (mgr.rank + 1) * per)
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, DIMS[0], generator=g), torch.randn(BATCH, DIMS[-1], generator=g)
        mgr.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
        opt.step()
        opt.zero_grad()


def flat(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict, in a fixed order; numbers as tensors."""
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in flat(v)]
    if isinstance(obj, torch.Tensor):
        return [obj.detach().reshape(-1).double()]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return [torch.tensor([float(obj)], dtype=torch.float64)]
    return []


def loaded(mgr: Any, stage: int, path: Path) -> tuple[list[torch.Tensor], dict[str, Any]]:
    model, opt = prepared(mgr, stage)
    extra = mgr.load_checkpoint(path, model, opt)
    state = flat(mgr.full_state_dict(model)) + flat(mgr.full_optimizer_state_dict(opt)["state"])
    opt.remove_hooks()
    return state, extra


def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return float("inf")
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True))


def run(mgr: Any, ns: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"backend": mgr.backend, "size": mgr.size}
    if ns.crashed is not None:
        latest = mgr.latest_checkpoint(ns.crashed)
        report["crashed_latest"] = latest.name if latest else None
        got, extra = loaded(mgr, ns.stage, latest)
        want, _ = loaded(mgr, ns.stage, ns.crashed / "ref" / "step-3")
        report["crashed_diff"], report["crashed_step"] = diff(got, want), extra["step"]
    model, opt = prepared(mgr, ns.stage)
    train(mgr, model, opt, range(3))
    mgr.save_checkpoint(ns.dir / "sync" / "step-3", model, opt, step=3)
    handle = mgr.save_checkpoint(ns.dir / "bg" / "step-3", model, opt, step=3, blocking=False)
    train(mgr, model, opt, range(3, 5))  # collectives on this thread while the writer writes
    report["latest_before_wait"] = str(mgr.latest_checkpoint(ns.dir / "bg"))
    report["waited"] = handle.wait().name
    report["published"] = handle.published and handle.done()
    trained = flat(mgr.full_state_dict(model)) + flat(mgr.full_optimizer_state_dict(opt)["state"])
    got, extra = loaded(mgr, ns.stage, ns.dir / "bg" / "step-3")
    want, _ = loaded(mgr, ns.stage, ns.dir / "sync" / "step-3")
    report["bg_vs_sync"], report["bg_vs_trained"], report["extra"] = diff(got, want), diff(got, trained), extra
    # a second save while one is in flight: the second call publishes the first before it starts
    first = mgr.save_checkpoint(ns.dir / "bg" / "step-5", model, opt, keep=2, step=5, blocking=False)
    train(mgr, model, opt, range(5, 6))
    second = mgr.save_checkpoint(ns.dir / "bg" / "step-6", model, opt, keep=2, step=6, blocking=False)
    report["first_published_by_second"] = first.published
    report["latest_in_flight"] = getattr(mgr.latest_checkpoint(ns.dir / "bg"), "name", None)
    second.wait()
    report["latest_after"] = getattr(mgr.latest_checkpoint(ns.dir / "bg"), "name", None)
    train(mgr, model, opt, range(6, 7))
    mgr.save_checkpoint(ns.dir / "bg" / "step-7", model, opt, keep=2, step=7, blocking=False)  # never waited for
    return report


def slow_writer(written: threading.Event) -> None:
    """The background writer writes 10 ms per block and says when it has written part of the shard."""
    write = ckfiles._Hashing.write

    def slow(self: Any, data: Any) -> int:
        n = write(self, data)
        if self.size > 4096:
            written.set()
        time.sleep(0.01)
        return n
    ckfiles._Hashing.write = slow  # type: ignore[method-assign]


def crash(mgr: Any, ns: argparse.Namespace) -> None:
    model, opt = prepared(mgr, ns.stage)
    train(mgr, model, opt, range(3))
    mgr.save_checkpoint(ns.dir / "step-3", model, opt, keep=1, step=3, blocking=False).wait()
    mgr.save_checkpoint(ns.dir / "ref" / "step-3", model, opt, step=3)
    train(mgr, model, opt, range(3, 5))
    written = threading.Event()
    slow_writer(written)
    handle = mgr.save_checkpoint(ns.dir / "step-5", model, opt, keep=1, step=5, blocking=False)
    step = 5
    # training goes on while the writers write, until every rank's has written part of its shard
    while not mgr.allreduce(torch.tensor([float(written.is_set())]), "min").item():
        train(mgr, model, opt, range(step, step + 1))
        step += 1
    if not handle.done():
        print(f"rank {mgr.rank}: killed mid-write after {step - 5} more steps", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("run", "crash"), required=True)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--crashed", type=Path)
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        if ns.phase == "crash":
            crash(mgr, ns)
            return 1  # not reached
        report = run(mgr, ns)
        if ns.out is not None:
            (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
