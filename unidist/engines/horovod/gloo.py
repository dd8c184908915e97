"""Horovod's gloo rendezvous for a job that horovodrun did not start and that has no MPI world: ``srun`` without
PMI (Debian's ``MpiDefault=none``).

Without MPI, ``hvd.init()`` would make every task a world of one. horovodrun would give each task its place in
``HOROVOD_*`` variables and serve Horovod's HTTP rendezvous; here the job step's layout comes from Slurm's
variables (``launch.slurm_step_hosts``) and rank 0 serves the rendezvous itself, at ``MASTER_ADDR:MASTER_PORT``
(the step's first node and a port derived from the job and step ids unless the user set them, as the torch
backend meets). The server is Horovod's own (``horovod.runner.http.http_server``): the C++ side's protocol is
its to define. The others wait until it answers before ``hvd.init()``, so no rank races its start.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from unidist.errors import LaunchEnvironmentError
from unidist.launch import LaunchInfo
from unidist.net import host_address, interfaces, listener, loopback_interface


def layout(rank: int, hosts: list[tuple[str, int]]) -> tuple[str, int, int, int, int]:
    """(hostname, local rank, local size, cross rank, cross size) of ``rank`` under Slurm's default block
    distribution of the step's tasks over ``hosts`` (name, tasks) in node-id order."""
    start = 0
    for node, (name, count) in enumerate(hosts):
        if rank < start + count:
            local = rank - start
            cross_size = sum(1 for _, c in hosts if c > local)
            cross_rank = sum(1 for _, c in hosts[:node] if c > local)
            return name, local, count, cross_rank, cross_size
        start += count
    raise LaunchEnvironmentError(f"rank {rank} is beyond the step's tasks {hosts}")


def _iface(master: str, single_node: bool) -> str | None:
    """The interface gloo should use: loopback on one node, else the one routing toward rank 0's host."""
    if single_node:
        return loopback_interface()
    try:
        toward = socket.gethostbyname(master)
    except OSError:
        toward = None
    mine = host_address(toward)
    return next((i.name for i in interfaces() if i.address == mine), None)


class Rendezvous:
    """Rank 0's Horovod rendezvous server (None elsewhere), kept until ``stop``."""

    def __init__(self, server: Any = None) -> None:
        self._server = server  # its serve_forever thread ends with shutdown()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start(launch: LaunchInfo, hosts: list[tuple[str, int]], setenv: Callable[[str, str], None],
          timeout: float) -> Rendezvous:
    """Set Horovod's gloo variables for this task and, on rank 0, serve its rendezvous; wait until it answers."""
    if not launch.master_addr or not launch.master_port:
        raise LaunchEnvironmentError("the horovod backend under srun without PMI meets at MASTER_ADDR:MASTER_PORT; "
                                     "Slurm gave neither a node list nor a job step id: set both")
    host, local_rank, local_size, cross_rank, cross_size = layout(launch.rank, hosts)
    single_node = len(hosts) == 1
    addr, port = launch.master_addr, launch.master_port
    values = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
              "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_HOSTNAME": host,
              "HOROVOD_RANK": str(launch.rank), "HOROVOD_SIZE": str(launch.size),
              "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": str(local_size),
              "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": str(cross_size)}
    iface = _iface(addr, single_node)
    if iface:
        values["HOROVOD_GLOO_IFACE"] = iface
    for name, value in values.items():
        setenv(name, value)
    rendezvous = Rendezvous()
    if launch.rank == 0:
        rendezvous = _serve(addr, port, launch.size, hosts)
    _wait_for(addr, port, timeout)
    return rendezvous


def _serve(addr: str, port: int, size: int, hosts: list[tuple[str, int]]) -> Rendezvous:
    import threading

    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    try:
        sock = listener(addr, port, fallback_any=True)
    except OSError as err:
        raise LaunchEnvironmentError(f"rank 0 cannot serve Horovod's rendezvous on {addr}:{port} ({err.strerror}): "
                                     "another job may hold the port; set MASTER_PORT to a free one") from err
    server = RendezvousHTTPServer(("127.0.0.1", 0), RendezvousHandler, 0)
    server.socket.close()  # serve on the socket held from the start, on the rendezvous address only
    server.socket, server.server_address = sock, sock.getsockname()[:2]
    server.init([SlotInfo(h, r, lr, cr, size, ls, cs)
                 for r in range(size) for h, lr, ls, cr, cs in [layout(r, hosts)]])
    threading.Thread(target=server.serve_forever, name="unidist-horovod-rendezvous", daemon=True).start()
    return Rendezvous(server)


def _wait_for(addr: str, port: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError as err:
            if time.monotonic() > end:
                raise LaunchEnvironmentError(f"Horovod's rendezvous at {addr}:{port} (rank 0) did not answer in "
                                             f"{timeout:g} s ({err}): is rank 0 running?") from err
            time.sleep(0.2)
