"""Rank 1 skips one allreduce, then every rank calls a broadcast: the bug a newcomer made (issue 40), for
tests/multiproc/test_short_timeout.py, which sets UNIDIST_TIMEOUT below UNIDIST_STALL_WARNING. Before the skip
each rank writes ``<out>/begin<rank>`` holding the wall time, so the test times the verdict and the job's end.
The lines the messages must name are marked ``# the allreduce rank 1 skips`` and ``# every rank``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import unidist

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args(unidist.script_args())

with unidist.init() as mgr:
    t = torch.ones(4)
    mgr.allreduce(t)
    mgr.barrier()
    (args.out / f"begin{mgr.rank}").write_text(f"{time.time():.3f}")
    if mgr.rank != 1:
        mgr.allreduce(t)  # the allreduce rank 1 skips
    mgr.broadcast(t, root=0)  # every rank
    print(f"rank {mgr.rank}: left the broadcast (it should not have)", flush=True)
