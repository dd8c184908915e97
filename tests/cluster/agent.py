"""The simulated cluster's sshd: runs, in the root namespaces, the commands ``ssh_standin.py`` forwards.

A command runs on its host (``nsenter`` into the host's namespaces) in a login environment (the cluster's
profile, nothing of the caller's: launchers must carry what their ranks need, as over
real ssh) under ``sh -c``, with the stand-in's stdin/stdout/stderr, in a session of its own. When the
stand-in's connection drops before the command ends, the whole session is killed.

Usage: agent.py CLUSTER_DIR  (reads CLUSTER_DIR/hosts.json, listens on CLUSTER_DIR/agent.sock)
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

OPTIONS_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")  # ssh(1)'s options that take an argument


def _options(argv: list[str], i: int) -> int:
    """The index of the first word at or after ``i`` that is not an option or an option's value."""
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        flags = argv[i][1:]
        for j, flag in enumerate(flags):
            if flag in OPTIONS_WITH_VALUE:
                if j == len(flags) - 1:
                    i += 1  # the value is the next word
                break
        i += 1
    return i


def parse_ssh(argv: list[str]) -> tuple[str, str]:
    """``(host, command)`` from an ssh command line; the user part of ``user@host`` is ignored. Options may
    also follow the host, as OpenSSH accepts (horovodrun writes ``ssh -o A h2 -o ConnectTimeout=10 cmd``)."""
    i = _options(argv, 0)
    if i < len(argv) and argv[i] == "--":
        i += 1
    if i >= len(argv):
        raise ValueError("no host")
    host = argv[i]
    i = _options(argv, i + 1)
    if i < len(argv) and argv[i] == "--":
        i += 1
    return host.rpartition("@")[2], " ".join(argv[i:])


def serve(conn: socket.socket, hosts: dict[str, dict[str, object]], profile: dict[str, str]) -> None:
    with conn:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        try:
            argv = json.loads(msg)
            host, command = parse_ssh(argv)
            info = hosts.get(host) or next((h for h in hosts.values() if h["address"] == host), None)
            if info is None:
                os.write(fds[2], f"ssh: Could not resolve hostname {host}: Name or service not known\n".encode())
                conn.sendall(b"255\n")
                return
            if not command:
                os.write(fds[2], b"ssh stand-in: no command (interactive logins are not simulated)\n")
                conn.sendall(b"255\n")
                return
            env = dict(profile)
            proc = subprocess.Popen(
                ["nsenter", "-t", str(info["pid"]), "-n", "-m", "-u", "-i", "-p", "--", "env", "-i",
                 *(f"{k}={v}" for k, v in env.items()), "sh", "-c", command],
                stdin=fds[0], stdout=fds[1], stderr=fds[2], start_new_session=True, cwd=env.get("HOME", "/"))
        finally:
            for fd in fds:
                os.close(fd)
        while True:
            ready, _, _ = select.select([conn], [], [], 0.2)
            if proc.poll() is not None:
                with contextlib.suppress(OSError):  # the stand-in may be gone already (its job was killed)
                    conn.sendall(f"{proc.returncode if proc.returncode >= 0 else 128 - proc.returncode}\n".encode())
                return
            if ready and not conn.recv(1):  # the stand-in died: end the session
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                return


def main() -> None:
    root = Path(sys.argv[1])
    spec = json.loads((root / "hosts.json").read_text())
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = root / "agent.sock.tmp"
    server.bind(str(tmp))
    server.listen(64)
    os.replace(tmp, root / "agent.sock")
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn, spec["hosts"], spec["profile"]), daemon=True).start()


if __name__ == "__main__":
    main()
