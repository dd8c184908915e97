"""TEMPORARY minimal stand-in (the lead's bootstrap); helper DIST's dist.py replaces it."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as tdist

from unidist.compat.deepspeed import state

__all__ = ["init_distributed"]


def init_distributed(*args: Any, **kwargs: Any) -> None:
    mgr = state.manager()
    if not tdist.is_initialized():
        port = 0
        if mgr.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = mgr.broadcast_object(port, 0) if mgr.size > 1 else port
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        tdist.init_process_group("gloo", rank=mgr.rank, world_size=mgr.size)
    for k, v in (("RANK", mgr.rank), ("WORLD_SIZE", mgr.size), ("LOCAL_RANK", mgr.local_rank)):
        os.environ[k] = str(v)
