"""A cluster of N hosts simulated on this machine (root only): what the several-host tests run on.

Each host is, measured to be needed for faithfulness (issue 23):
- a network namespace with one interface, ``eth0``, a veth whose other end sits on a bridge in a switch
  namespace of its own, an address ``10.77.0.<i>/24`` and a default route on ``eth0``; loopback up;
- its own UTS (hostname), PID, IPC and mount namespaces, with a private ``/dev/shm`` (tmpfs), an ``/etc/hosts``
  naming every host, a ``/tmp`` of its own and its own ``/proc/sys/kernel/random/boot_id`` (a file bind-mounted
  over it after the namespace's /proc is mounted). Without the boot id, PID and IPC isolation, UCX (MPICH's
  transport) decides the fake hosts are one machine and reaches across them through shared memory and /proc,
  so cutting a host's link would change nothing.
The filesystem is otherwise shared, as a cluster's home directory on NFS is; /tmp is each host's own, so the
cluster's files (and a test's outputs: ``Cluster.shared``) live under /var/tmp. No ``TMPDIR`` is set: mpiexec
would hand the launching host's to every rank.

A host's namespaces are held by one process per host (``sleep``, pid 1 of the host's PID namespace); killing it
ends every process of the host. Commands enter a host with ``nsenter``. Remote starts (``ssh h2 cmd`` from
mpiexec, horovodrun, DeepSpeed's runner) go through ``ssh_standin.py``: a sibling PID namespace cannot be
entered from inside another, so the stand-in asks the cluster's agent (``agent.py``, in the root namespaces)
over a unix socket to start the command on the named host with the caller's stdin/stdout/stderr, as sshd would.
``pdsh`` (DeepSpeed's multinode runner) and ``srun`` (a Slurm job step) stand-ins start their commands through
that ssh stand-in. A cluster can also have no pdsh at all (``pdsh="none"``: the machine's own is hidden on every
host) or the machine's real one (``pdsh="system"``, Debian's ``pdsh``, which reaches the hosts through the ssh
stand-in as it would through ssh).
No address outside the namespaces made here is ever a target.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED_ROOT = "/var/tmp"  # not /tmp, which is each host's own
SUBNET = "10.77.0"
# what a login shell on every host has (a user's ~/.profile): the interpreter's bin first, then the system's
PROFILE_KEYS = ("PATH", "PYTHONPATH", "HOME", "USER", "LOGNAME", "LANG", "OMP_NUM_THREADS", "DS_ACCELERATOR")
PDSH_MODES = ("standin", "system", "none")  # Cluster(pdsh=...): the stand-in, the machine's own, or none at all


class ClusterUnavailableError(RuntimeError):
    """This machine cannot simulate hosts (not root, or ``ip``/``unshare``/``nsenter`` missing)."""


def why_unavailable() -> str | None:
    """Why no cluster can be built here, or None when one can."""
    if sys.platform != "linux":
        return "a simulated cluster needs Linux namespaces"
    if os.geteuid() != 0:
        return "a simulated cluster needs root (network, PID and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"a simulated cluster needs `{tool}` (iproute2 / util-linux)"
    return None


def sweep() -> None:
    """Remove what clusters of processes that no longer exist left behind (a test run killed mid-way)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        m = re.fullmatch(r"ud(\d+)x[0-9a-f]{4}-\w+", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Host:
    name: str
    address: str
    namespace: str  # the network namespace (``ip netns``)
    pid: int  # the host's init, as this (root) PID namespace numbers it
    tmp: Path  # its /tmp, as the test sees it
    init: subprocess.Popen[bytes]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Cluster:
    """``Cluster(2).up()`` builds h1 and h2; ``down()`` (or the context manager) removes everything it made.

    Args:
        n: how many hosts.
        names: their host names (default h1 ... hn).
        profile: environment variables every host's login shell has (default: this process's PATH, PYTHONPATH,
            HOME, USER, LANG, OMP_NUM_THREADS and DS_ACCELERATOR).
        pdsh: ``"standin"`` (pdsh_standin.py first on every host's PATH), ``"system"`` (the machine's own pdsh,
            if any: no stand-in) or ``"none"`` (no pdsh on any host: no stand-in, and every ``pdsh`` on the hosts'
            PATH covered, inside the hosts' mount namespaces only, by /dev/null, which is not executable).
    """

    def __init__(self, n: int, profile: Mapping[str, str] | None = None, names: Sequence[str] | None = None,
                 pdsh: str = "standin") -> None:
        reason = why_unavailable()
        if reason:
            raise ClusterUnavailableError(reason)
        if pdsh not in PDSH_MODES:
            raise ValueError(f"pdsh={pdsh!r}: use one of {', '.join(PDSH_MODES)}")
        self.pdsh = pdsh
        self.n = n
        self.names = list(names) if names else [f"h{i + 1}" for i in range(n)]
        if len(self.names) != n:
            raise ValueError(f"{n} hosts need {n} names, got {self.names}")
        self.tag = f"ud{os.getpid()}x{uuid.uuid4().hex[:4]}"  # namespace names: unique per cluster (see sweep)
        self.dir = Path(tempfile.mkdtemp(prefix=f"unidist-cluster-{self.tag}-", dir=SHARED_ROOT))
        self.bin = self.dir / "bin"
        self.shared = self.dir / "shared"  # seen alike on every host and by the test
        self.hosts: dict[str, Host] = {}
        self.switch = f"{self.tag}-sw"
        base = {k: os.environ[k] for k in PROFILE_KEYS if k in os.environ}
        base["PATH"] = os.pathsep.join([str(self.bin), str(Path(sys.executable).parent),
                                        base.get("PATH", "/usr/bin:/bin")])
        self.profile = {**base, **(profile or {})}
        self.agent: subprocess.Popen[bytes] | None = None

    # -- building and removing ------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Cluster:
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        self.bin.mkdir()
        self.shared.mkdir()
        # the stand-ins, each handed what it reaches the hosts through: ssh the agent, the others ssh
        for tool, first in (("ssh", self.dir / "agent.sock"), ("pdsh", self.bin / "ssh"), ("srun", self.bin / "ssh")):
            if tool == "pdsh" and self.pdsh != "standin":
                continue
            stub = self.bin / tool
            stub.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / f'{tool}_standin.py'} {first} " '"$@"\n')
            stub.chmod(0o755)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        names = self.names
        hosts_file = self.dir / "hosts"
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} {h}\n"
                                                                  for i, h in enumerate(names)))
        for i, name in enumerate(names):
            self.hosts[name] = self._host(i, name, hosts_file)
            if self.pdsh == "none":
                self._hide(name, "pdsh")
        (self.dir / "hosts.json").write_text(json.dumps({"profile": self.profile, "hosts": {
            h.name: {"address": h.address, "pid": h.pid, "tmp": str(h.tmp)} for h in self.hosts.values()}}))
        sock = self.dir / "agent.sock"
        self.agent = subprocess.Popen([sys.executable, str(HERE / "agent.py"), str(self.dir)],
                                      start_new_session=True)
        _wait_for(sock.exists, 10, "the cluster's agent did not start")

    def _host(self, i: int, name: str, hosts_file: Path) -> Host:
        ns, address = f"{self.tag}-{name}", f"{SUBNET}.{i + 1}"
        _ip("netns", "add", ns)
        _ip("-n", self.switch, "link", "add", f"v{name}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", f"v{name}", "master", "br0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "dev", "eth0")
        home = self.dir / name
        tmp = home / "tmp"
        tmp.mkdir(parents=True)
        tmp.chmod(0o1777)
        (home / "boot_id").write_text(str(uuid.uuid4()) + "\n")
        ready = home / "ready"
        script = ('hostname "$1" && mount -t tmpfs -o size=4g tmpfs /dev/shm && mount --bind "$2" /etc/hosts && '
                  'mount --bind "$3" /proc/sys/kernel/random/boot_id && mount --bind "$5" /tmp && touch "$4" && '
                  'exec sleep infinity')
        init = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--pid", "--fork", "--mount-proc", "--uts", "--ipc", "--mount",
             "--propagation", "private", "sh", "-c", script, "init", name, str(hosts_file), str(home / "boot_id"),
             str(ready), str(tmp)], start_new_session=True, stdin=subprocess.DEVNULL)
        _wait_for(ready.exists, 10, f"host {name} did not come up")
        with open(f"/proc/{init.pid}/task/{init.pid}/children") as f:
            pid = int(f.read().split()[0])
        return Host(name, address, ns, pid, tmp, init)

    def _hide(self, host: str, program: str) -> None:
        """Cover every ``program`` on the hosts' PATH with /dev/null inside ``host`` (its mount namespace only):
        neither ``shutil.which`` nor a shell finds it there, and this machine keeps it."""
        for folder in self.profile["PATH"].split(os.pathsep):
            path = Path(folder) / program
            if path.exists():
                subprocess.run(["nsenter", "-t", str(self.hosts[host].pid), "-m", "--", "mount", "--bind",
                                "/dev/null", str(path)], check=True, capture_output=True)

    def which(self, host: str, program: str) -> str | None:
        """Where ``host``'s login shell finds ``program`` (None: not on its PATH)."""
        found = self.run(host, ["sh", "-c", f"command -v {program}"], timeout=30).stdout.strip()
        return found or None

    def down(self) -> None:
        """Kill every process of every host (each host's init takes its PID namespace with it), the agent, the
        namespaces and the files. Safe to call twice and after a failed ``up``."""
        if self.agent is not None:
            _kill(self.agent)
            self.agent = None
        for host in self.hosts.values():
            try:
                os.kill(host.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _kill(host.init)
        for ns in [h.namespace for h in self.hosts.values()] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.hosts = {}
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- running --------------------------------------------------------------------------------------------
    def enter(self, host: str) -> list[str]:
        """The argv prefix that runs a command inside ``host`` (all its namespaces; a child of its init)."""
        return ["nsenter", "-t", str(self.hosts[host].pid), "-n", "-m", "-u", "-i", "-p", "--"]

    def env(self, host: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A login environment on ``host``: the profile, then ``extra``."""
        return {**self.profile, **(extra or {})}

    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` (in ``cwd``, default the shared directory) in a new session (kill it all
        with ``os.killpg``)."""
        return subprocess.Popen([*self.enter(host), "env", "-i", "-C", cwd or str(self.shared),
                                 *(f"{k}={v}" for k, v in self.env(host, env).items()), *argv],
                                start_new_session=True, text=True, **kwargs)  # type: ignore[call-overload]

    def run(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 300,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to its end (or ``timeout``: then the whole session is killed)."""
        proc = self.popen(host, argv, env, cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[fakehosts: killed after {timeout} s]"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- faults ---------------------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Cut ``host``'s link (its cable out of the switch): packets to and from it are dropped."""
        _ip("-n", self.switch, "link", "set", f"v{host}", "down")

    def mend(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", f"v{host}", "up")

    def kill_all(self, host: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process on ``host`` except its init."""
        subprocess.run([*self.enter(host), "sh", "-c", f"kill -{int(sig)} -1"], capture_output=True)

    def processes(self, host: str) -> str:
        """``ps`` inside ``host``: what runs there."""
        return self.run(host, ["ps", "-eo", "pid,stat,args"]).stdout


def _wait_for(cond: object, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not cond():  # type: ignore[operator]
        if time.monotonic() > end:
            raise ClusterUnavailableError(what)
        time.sleep(0.02)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
