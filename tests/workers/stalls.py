"""Three stalls in one job, for the stall inspector (UNIDIST_STALL_WARNING, set low by the test): the last rank
is first a straggler (it sleeps before a collective), then stopped (SIGSTOP, a second after the others began
waiting; a child process resumes it later), then it skips the last collective and leaves its ``with`` block.
The other ranks wait each time with the default UNIDIST_TIMEOUT; the inspector must say why, and end the job
at the skipped collective.

Before each stall the last rank writes ``<out>/<name>`` holding the wall time it begins, so the test times how
long each verdict took. ``--straggle`` and ``--stop`` are the seconds of the first two stalls.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import unidist

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--straggle", type=float, default=6.0)
parser.add_argument("--stop", type=float, default=12.0)
parser.add_argument("--local_rank", type=int)  # the deepspeed launcher appends it
args = parser.parse_args(unidist.script_args())


def mark(name: str) -> None:
    (args.out / name).write_text(f"{time.time():.3f}")
    print(f"stall worker: {name} begins", flush=True)


with unidist.init() as mgr:
    last = mgr.rank == mgr.size - 1
    t = torch.ones(4)
    mgr.allreduce_(t)
    if last:
        mark("straggler")
        time.sleep(args.straggle)
    mgr.allreduce_(t)
    mgr.barrier()
    if last:
        # a child sends SIGCONT later: a stopped process cannot resume itself
        subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep({args.stop}); "
                          f"os.kill({os.getpid()}, signal.SIGCONT)"], start_new_session=True)
        # stopped once the others wait in the allreduce below: under Horovod a rank that *enters* a collective
        # after its peer stopped blocks in the enqueue holding the GIL, where no Python thread can speak, and
        # Horovod's gloo timeout ends it instead (docs/reliability.md); CI's loaded rank 0 was that late once
        time.sleep(1.0)
        mark("stopped")
        os.kill(os.getpid(), signal.SIGSTOP)
    mgr.allreduce_(t)
    mgr.barrier()
    if last:
        mark("desync")  # skips the allreduce below, and leaves
    else:
        mgr.allreduce_(t)
    print(f"rank {mgr.rank}: left the last collective (it should not have)", flush=True)
