"""``with mgr.accumulate(model):`` under any launcher, at ZeRO stages 0-3: no communication in the micro-steps,
and the update of one process on the whole batch.

Each step is 3 micro-batches in one ``accumulate`` block (each loss divided by 3), then ``opt.step()``. Inside
the block the ranks take their micro-steps one after another: rank r waits for a token from rank r-1 before its
micro-steps and passes it on after them. A micro-step that waited on a peer (a blocking allreduce, a ZeRO-3
parameter fetch) would then never return, and the watchdog ends the job (``UNIDIST_TIMEOUT``). On unidist's own
engines the watched call counter must also not move across the micro-steps (catching non-blocking sends too).
DeepSpeed's own ZeRO-3 fetches parameters in every forward (its ``coalesce_grad_reduction`` coalesces only the
gradient reduction), so there the micro-steps run side by side and only the result is checked.

The reference: one process, the same 3 whole micro-batches accumulated, plain torch. Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from common import max_diff, spread
from zero import make_model  # tests/workers/zero.py: this script's directory is on sys.path

import unidist
from unidist.comm import watchdog

STEPS, MICRO, ROWS = 3, 3, 12  # ROWS per micro-batch (split over the ranks)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + micro)
    return torch.randn(ROWS, 64, generator=g) * 3, torch.randn(ROWS, 8, generator=g) * 10


def make_opt(model: torch.nn.Module, adam: bool) -> torch.optim.Optimizer:
    if adam:
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def reference(adam: bool) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = make_opt(model, adam)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = batch(step, micro)
            (torch.nn.functional.mse_loss(model(x), y) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train(mgr: Any, stage: int, adam: bool) -> tuple[dict[str, torch.Tensor], int]:
    model = make_model()
    model, opt = mgr.prepare(model, make_opt(model, adam), zero_stage=stage)
    token = torch.zeros(1)
    moved = 0  # watched engine calls made during this rank's micro-steps
    per = ROWS // mgr.size
    rows = slice(mgr.rank * per, (mgr.rank + 1) * per)
    one_by_one = not (mgr.backend == "deepspeed" and stage == 3)
    for step in range(STEPS):
        with mgr.accumulate(model):
            if mgr.rank > 0 and one_by_one:
                mgr.recv(token, mgr.rank - 1)
            before = watchdog.calls()
            for micro in range(MICRO):
                x, y = batch(step, micro)
                mgr.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / MICRO)
            moved += watchdog.calls() - before
            if mgr.rank < mgr.size - 1 and one_by_one:
                mgr.send(token, mgr.rank + 1)
        opt.step()
        opt.zero_grad()
    full = mgr.full_state_dict(model)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return full, moved


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        results: dict[str, Any] = {}
        for adam in (False, True):
            want = reference(adam)
            for stage in range(4):
                key = f"{'adam' if adam else 'sgd'}/stage{stage}"
                try:
                    got, moved = train(mgr, stage, adam)
                    results[key] = {"diff": max_diff(got, want), "spread": spread(mgr, got),
                                    "calls_in_micro_steps": moved}
                except Exception as err:  # recorded; the other cases still run on every rank
                    traceback.print_exc()
                    results[key] = {"error": f"{type(err).__name__}: {err}"}
        results["_meta"] = {"backend": mgr.backend, "size": mgr.size}
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(results, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
