"""``ssh`` on the simulated cluster: hands its argv and stdin/stdout/stderr to the cluster's agent, which runs
the command on the named host, and exits with the command's code (255 when the host is unknown, as ssh does).
If this process is killed, the agent kills what it started, as sshd ends a session whose connection dropped.

Usage (what the cluster's ``bin/ssh`` runs): ssh_standin.py AGENT_SOCKET [ssh options] HOST COMMAND...
"""

from __future__ import annotations

import array
import json
import socket
import sys


def main() -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    fds = array.array("i", [0, 1, 2])
    sock.sendmsg([json.dumps(sys.argv[2:]).encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            print("ssh stand-in: the cluster's agent went away", file=sys.stderr)
            return 255
        reply += chunk
    return int(reply)


if __name__ == "__main__":
    sys.exit(main())
