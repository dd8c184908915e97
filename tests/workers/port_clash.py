"""Rank 0's rendezvous port is taken (as another job on the machine could take it between the check and the
bind): the torch backend started by mpiexec must end the whole job, not leave the other ranks waiting."""

import socket

import unidist
import unidist.managers.torch as torch_manager

held = socket.socket()
held.bind(("", 0))
held.listen()
torch_manager.free_port = lambda host="127.0.0.1": held.getsockname()[1]  # type: ignore[assignment]
with unidist.init() as mgr:
    print("started despite the taken port", flush=True)
