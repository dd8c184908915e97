"""Fault injection: the last rank misbehaves at step 3 of a short data-parallel training loop.

--fault kill    SIGKILL itself                  stop     SIGSTOP itself (stuck: the others must time out)
        raise   raise ValueError                 exit0    sys.exit(0) inside the with block
        sum_max allreduce with op=max while the others use sum (needs UNIDIST_CHECK_COLLECTIVES)
        kind    broadcast while the others allreduce
        outside the test does it (cuts the rank's host off, kills the host): the rank writes <out>/asked and
                waits for <out>/fault (written by the test, with the time), then goes on with the step
Every rank writes <out>/pid<R>, and the ranks start together when all are there; the faulty rank writes
<out>/fault (the wall time of the fault), so the test can time the job's end from the fault and clean up a
stopped rank the launcher left behind. The
healthy ranks' step makes the backend's own gradient exchange wait (DeepSpeed's engine, Horovod's
optimizer, unidist's hooks), then an allreduce.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

import unidist

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--fault", required=True, choices=["kill", "stop", "raise", "exit0", "sum_max", "kind", "outside"])
parser.add_argument("--local_rank", type=int)  # the deepspeed launcher appends it
args = parser.parse_args(unidist.script_args())


def start_together(out: Path, size: int) -> None:
    """Wait (up to 120 s) until every rank has written its pid file: the faults are run with a short
    UNIDIST_TIMEOUT (3 s), and on a loaded machine the ranks of one host reached the first collective 3 s after
    another host's (after init: imports, the model), which ended the job before its fault. The files are
    outside unidist, so this wait is not bounded by UNIDIST_TIMEOUT."""
    end = time.monotonic() + 120
    while sum(1 for _ in out.glob("pid*")) < size and time.monotonic() < end:
        time.sleep(0.02)


with unidist.init() as mgr:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    (args.out / f"pid{mgr.rank}").write_text(str(os.getpid()))
    start_together(args.out, mgr.size)
    model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    faulty = mgr.rank == mgr.size - 1
    gen = torch.Generator().manual_seed(mgr.rank)
    for step in range(6):
        x = torch.randn(16, 64, generator=gen)
        loss = model(x).pow(2).mean()
        if faulty and step == 3 and args.fault == "outside":
            (args.out / "asked").write_text(f"{time.time():.3f}")  # the others are on their way into the step
            end = time.monotonic() + 60
            while not (args.out / "fault").exists() and time.monotonic() < end:
                time.sleep(0.05)
        elif faulty and step == 3:
            (args.out / "fault").write_text(f"{time.time():.3f}")
            print(f"rank {mgr.rank}: injecting {args.fault}", flush=True)
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "raise":
                raise ValueError(f"deliberate failure on rank {mgr.rank}")
            elif args.fault == "exit0":
                sys.exit(0)
        mgr.backward(loss)
        opt.step()
        opt.zero_grad()
        t = torch.full((4,), float(mgr.rank + 1))
        if faulty and step == 3 and args.fault == "sum_max":
            mgr.allreduce_(t, op="max")
        elif faulty and step == 3 and args.fault == "kind":
            mgr.broadcast_(t, root=0)
        else:
            mgr.allreduce_(t)
    print(f"rank {mgr.rank}: finished, last allreduce {t.tolist()}", flush=True)
