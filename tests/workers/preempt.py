"""Preemption from outside: the test signals one rank's process while every rank loops over small steps.

--mode agree   every step calls stop.requested() (agreeing once in --every calls); when it is True each rank
               writes <out>/rank<R>.json: the step, stop.signal, stop.received_at and the time it stopped
--mode ignore  never calls stop.requested(): a SIGTERM must still end the process after --grace seconds

Every rank writes <out>/pid<R> once its handlers are installed; rank 0 writes <out>/ready when all are (the
test signals after that). A step is an allreduce and a 5 ms sleep, so a signal lands inside either. No rank
loops longer than 60 s: one that never stopped writes step None.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import unidist

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--mode", choices=["agree", "ignore"], required=True)
parser.add_argument("--every", type=int, default=1)
parser.add_argument("--grace", type=float, default=None)
parser.add_argument("--local_rank", type=int)  # the deepspeed launcher appends it
args = parser.parse_args(unidist.script_args())

with unidist.init() as mgr:
    stop = mgr.preemption(every=args.every, grace=args.grace)
    (args.out / f"pid{mgr.rank}").write_text(str(os.getpid()))
    mgr.barrier()
    if mgr.is_main:
        (args.out / "ready").write_text(f"{time.time():.3f}")
    grad = torch.ones(1024)
    report: dict[str, object] = {"step": None}
    end = time.monotonic() + 60
    step = 0
    while time.monotonic() < end:
        step += 1
        mgr.allreduce(grad)
        time.sleep(0.005)
        if args.mode == "agree" and stop.requested():
            report = {"step": step, "signal": stop.signal, "received_at": stop.received_at,
                      "stopped_at": time.time()}
            break
    (args.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))
