"""The TCP stores unidist hosts for an engine (the torch/DeepSpeed world's, Horovod's side group's): served on a
socket rank 0 already holds, and left in order.

torch's TCPStore, given a host and port, listens on every interface and binds the port only when it starts; a
store built on ``net.listener``'s socket serves on exactly one address and nobody can take its port first.
Rank 0's process hosts such a store, so it must close last: a store closing under a connected peer aborted
that peer at exit, under load ("terminate called without an active exception").
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["connect", "leave_in_order", "serve"]

_LEFT_KEY = "unidist/left"  # ranks other than 0 count themselves out here


def _dist() -> Any:
    import torch.distributed

    return torch.distributed  # TCPStore: not in its typed exports


def serve(sock: socket.socket, size: int, timeout: timedelta) -> Any:
    """Rank 0's store on ``sock`` (bound and listening; the store takes it over).

    Args:
        sock: from ``net.listener``.
        size: ranks that will connect, rank 0 included.
        timeout: how long a store operation may wait.
    """
    host, port = sock.getsockname()[:2]
    return _dist().TCPStore(host, port, size, is_master=True, master_listen_fd=sock.detach(), timeout=timeout,
                            wait_for_workers=False)


def connect(host: str, port: int, size: int, timeout: timedelta) -> Any:
    """A client of the store rank 0 (or a launcher's agent) serves at ``host:port``."""
    return _dist().TCPStore(host, port, size, is_master=False, timeout=timeout)


def leave_in_order(store: Any, rank: int, size: int, timeout: float, release: Callable[[], None]) -> None:
    """``release`` the engine's group on every rank, rank 0 (the store's host) after all the others.

    Args:
        store: the store every rank shares (a client on rank > 0).
        rank, size: this rank and the number of ranks on the store.
        timeout: seconds rank 0 waits for the others before it releases anyway.
        release: drops this rank's group (``destroy_process_group``, or the last reference).
    """
    if rank != 0:
        release()
        store.add(_LEFT_KEY, 1)
        return
    deadline = time.monotonic() + timeout
    while store.add(_LEFT_KEY, 0) < size - 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    release()
