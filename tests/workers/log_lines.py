"""UNIDIST_LOG_LEVEL under a launcher (tests/multiproc/test_logging.py): start, one collective, one line of the
script's own on the "unidist" logger, leave. ``--configured``: the script configures logging first, so its
logging decides. Each rank prints how many handlers the "unidist" logger has once the Manager is gone."""

from __future__ import annotations

import argparse
import logging

import torch

import unidist

parser = argparse.ArgumentParser()
parser.add_argument("--configured", action="store_true")
args = parser.parse_args(unidist.script_args())
if args.configured:
    logging.basicConfig(level=logging.INFO, format="the script's own: %(name)s %(levelname)s %(message)s")

with unidist.init() as mgr:
    mgr.allreduce(torch.ones(4))
    logging.getLogger("unidist").info("rank %d: after the allreduce", mgr.rank)
    rank = mgr.rank
print(f"rank {rank}: handlers after shutdown: {len(logging.getLogger('unidist').handlers)}", flush=True)
