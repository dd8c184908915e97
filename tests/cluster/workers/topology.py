"""What a rank is told about the cluster, one allreduce, and its listening sockets; rank 0 writes all ranks'
to its first argument as JSON (``unidist.script_args``: the deepspeed launcher appends ``--local_rank=N``).
Sockets open before unidist started (inherited from the launcher) are reported apart."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))

import torch
from sockets import listening

import unidist

inherited = listening()
out = Path(unidist.script_args()[0])
with unidist.init() as mgr:
    total = mgr.allreduce(torch.full((3,), float(mgr.rank + 1)))
    mine = {"host": socket.gethostname(), "rank": mgr.rank, "size": mgr.size, "local_rank": mgr.local_rank,
            "local_size": mgr.local_size, "node_rank": mgr.node_rank, "backend": mgr.backend,
            "sum": total.tolist(), "listen": listening(), "inherited": inherited,
            "timeout": mgr.config.timeout}
    ranks = mgr.allgather_object(mine)
    if mgr.rank == 0:
        out.write_text(json.dumps(ranks))
