"""``pdsh`` on the simulated cluster, as much of it as DeepSpeed's multinode runner uses (its PDSHRunner runs
``pdsh -S -f 1024 -w h1,h2 <command words>``): the command runs on every ``-w`` host through ``ssh`` (the
cluster's ssh stand-in, beside this one on PATH) with ``PDSH_SSH_ARGS_APPEND``, ``%h`` replaced by the host and
``%n`` by its index in the list, every output line prefixed with ``host: `` as pdsh does. Exit code: with
``-S`` the largest remote one, else 1 if any host failed.

Usage (what the cluster's ``bin/pdsh`` runs): pdsh_standin.py SSH [pdsh options] COMMAND...
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from typing import IO

from hostlist import expand

FLAGS = set("SNbdsqV")  # pdsh options without a value
VALUED = set("fwxRluteo")  # pdsh options with one (the value may be glued: -f1024)


def parse(argv: list[str]) -> tuple[dict[str, str], str]:
    """pdsh's options (the last of each, ``-w`` lists joined) and the command (the remaining words joined by
    spaces, as pdsh hands them to the remote shell)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and len(argv[i]) > 1:
        word = argv[i]
        if word == "--":
            i += 1
            break
        flag = word[1]
        if flag in FLAGS and len(word) == 2:
            opts[flag] = ""
        elif flag in VALUED:
            value = word[2:] if len(word) > 2 else argv[i + 1]
            i += 0 if len(word) > 2 else 1
            opts[flag] = f"{opts[flag]},{value}" if flag == "w" and "w" in opts else value
        else:
            raise SystemExit(f"pdsh stand-in: option {word} is not simulated")
        i += 1
    return opts, " ".join(argv[i:])


def _relay(stream: IO[bytes], sink: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``sink`` line by line, each prefixed (lines of several hosts never interleave)."""
    for line in iter(stream.readline, b""):
        with lock:
            sink.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
            sink.flush()


def main() -> int:
    ssh, argv = sys.argv[1], sys.argv[2:]
    opts, command = parse(argv)
    if "w" not in opts or not command:
        print("usage: pdsh [-S] [-f fanout] -w hosts command...", file=sys.stderr)
        return 2
    hosts = expand(opts["w"])
    excluded = set(expand(opts["x"])) if "x" in opts else set()
    hosts = [h for h in hosts if h not in excluded]
    append = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    user = ["-l", opts["l"]] if "l" in opts else []
    lock = threading.Lock()
    procs, relays = [], []
    for n, host in enumerate(hosts):
        remote = command.replace("%h", host).replace("%n", str(n))
        proc = subprocess.Popen([ssh, *user, *append, host, remote], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)
        for stream, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            prefix = b"" if "N" in opts else f"{host}: ".encode()  # -N: no host prefix
            t = threading.Thread(target=_relay, args=(stream, sink, prefix, lock), daemon=True)
            t.start()
            relays.append(t)

    def stop(signum: int, _: object) -> None:  # pdsh ends its connections (the remote sessions) when stopped
        for proc in procs:
            proc.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [proc.wait() for proc in procs]
    for t in relays:
        t.join()
    for host, code in zip(hosts, codes, strict=True):
        if code:
            print(f"pdsh@{os.uname().nodename}: {host}: ssh exited with exit code {code}", file=sys.stderr)
    if "S" in opts:
        return max(codes, default=0)
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
