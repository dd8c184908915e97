"""A real Slurm (munged, slurmctld, slurmd from Debian's ``slurm-wlm`` and ``munge``) started in a directory.

Installs nothing: CI installs the packages (``.ci/install_slurm.sh``); ``missing()`` says why a test cannot run
here (no packages, not root). ``SlurmCluster`` writes a munge key, a ``slurm.conf`` naming this host (or the
simulated hosts of ``tests/cluster/fakehosts.py``, one slurmd each) with its CPUs, ``MpiDefault=none`` as
Debian ships it, no accounting, no cgroups, then starts the daemons, waits for the nodes to be idle, and stops
everything on exit. Clients find it through ``SLURM_CONF`` (``env()``): nothing outside the directory is
touched, and the ports are chosen free, so a second cluster or the system's own Slurm do not collide.

    python tests/slurm/slurmcluster.py srun -n 2 env    # a throwaway cluster around one command
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
KILL_WAIT = 5  # seconds between scancel's SIGTERM and SIGKILL (Slurm's default is 30)


def missing() -> str | None:
    """Why a real Slurm cannot be started here, or None."""
    absent = [p for p in (*DAEMONS, *CLIENTS) if not shutil.which(p, path=os.environ.get("PATH", "") + ":/usr/sbin")]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a real Slurm needs root here (slurmd starts tasks as the submitting user through its own daemons)"
    return None


def _die_with_parent() -> None:
    """In the daemon's child before exec: SIGTERM when the test process dies (a killed pytest must not leave a
    cluster running; its jobs would then share this host with the next one's)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _signal(proc: subprocess.Popen[Any], sig: int) -> None:
    """``sig`` to the process group ``proc`` leads (every daemon starts a session of its own): a daemon started
    through ``nsenter`` (a simulated host) is the child of the process started, which passes no signal on."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        proc.send_signal(sig)


def _which(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin")
    if not found:
        raise FileNotFoundError(name)
    return found


class SlurmCluster:
    """Daemons of one Slurm cluster under ``root``; ``nodes`` maps a node name to (address, CPUs).

    ``run_on(node, argv)`` starts a node's slurmd (by default here; the several-host tests pass one that enters a
    simulated host), and slurmctld too when ``ctld_host`` names one of the nodes. ``client`` is the argv prefix
    that runs a client command (sinfo, scontrol, srun...) where slurmctld is reachable (default: here, as is;
    the several-host tests enter the controller's host). A single node is this host under its hostname. munged
    runs here; its socket is under ``root``, which every simulated host sees (/var/tmp)."""

    def __init__(self, root: Path | None = None, nodes: Mapping[str, tuple[str, int]] | None = None,
                 run_on: Callable[[str, list[str], Path], subprocess.Popen[Any]] | None = None,
                 ctld_host: tuple[str, str] | None = None, client: Sequence[str] = ()) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="unidist-slurm-", dir="/var/tmp"))
        self.nodes = dict(nodes or {socket.gethostname(): ("127.0.0.1", os.cpu_count() or 1)})
        self.ctld_host = ctld_host or (socket.gethostname(), "127.0.0.1")
        self.run_on = run_on or self._local
        self.client = list(client)
        self.procs: list[subprocess.Popen[Any]] = []
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    # --- files ----------------------------------------------------------------------------------------------
    def _write(self) -> None:
        for d in ("munge", "state", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        (self.root / "munge").chmod(0o700)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        ctld_port, node_port = _free_port(), _free_port()
        lines = [
            "ClusterName=unidist", f"SlurmctldHost={self.ctld_host[0]}({self.ctld_host[1]})",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={node_port}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}", f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'spool' / '%n' / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", f"KillWait={KILL_WAIT}", "MinJobAge=30",
            # job ids of their own: MPICH names its shared-memory segments after the PMI job id ("3.0"), so two
            # clusters alive at once (another test session) numbering from 1 would cross their jobs' MPI_Init
            f"FirstJobId={random.randrange(1000, 10**6)}",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "LaunchParameters=enable_nss_slurm",
            "PrologFlags=", "PropagateResourceLimitsExcept=ALL",
        ]
        lines = [x for x in lines if not x.endswith("=")]
        lines.remove("LaunchParameters=enable_nss_slurm")
        for node, (addr, cpus) in self.nodes.items():
            lines.append(f"NodeName={node} NodeAddr={addr} CPUs={cpus} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
                     "OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a client (srun, sbatch, scontrol) needs to reach this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin"
        return env

    # --- daemons ----------------------------------------------------------------------------------------------
    def _local(self, node: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as sink:
            return subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=self.env(),
                                    start_new_session=True, preexec_fn=_die_with_parent)

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=self.env(),
                                    start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Write the files, start munged, slurmctld and every slurmd, and wait until every node is idle."""
        self._write()
        logs = self.root / "log"
        self._spawn([_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                     f"--key-file={self.root / 'munge' / 'munge.key'}", f"--pid-file={self.root / 'munge' / 'pid'}",
                     f"--seed-file={self.root / 'munge' / 'seed'}", f"--log-file={logs / 'munged.log'}"],
                    logs / "munged.out")
        self._until(lambda: self.munge_socket.exists(), 10, "munged did not create its socket")
        ctld = [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)]
        if self.ctld_host[0] in self.nodes:
            self.procs.append(self.run_on(self.ctld_host[0], ctld, logs / "slurmctld.out"))
        else:
            self._spawn(ctld, logs / "slurmctld.out")
        for node in self.nodes:
            argv = [_which("slurmd"), "-D", "-f", str(self.conf), "-N", node]
            self.procs.append(self.run_on(node, argv, logs / f"slurmd-{node}.out"))
        self._until(self._idle, timeout, "the nodes did not become idle")
        return self

    def _idle(self) -> bool:
        out = subprocess.run([*self.client, "sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True,
                             text=True)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

    def _until(self, ok: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(p.poll() is not None for p in self.procs):
                break
            try:
                if ok():
                    return
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout:g} s; logs in {self.root / 'log'}:\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted((self.root / "log").glob("*")) if p.is_file())

    def run(self, argv: Sequence[str], timeout: float = 300, env: Mapping[str, str] | None = None,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
        """A client command (srun, sbatch, ...) against this cluster, output captured."""
        # entering a host's mount namespace (nsenter -m) starts in its /: the directory is set inside
        where = ["env", "-C", str(cwd)] if self.client and cwd is not None else []
        return subprocess.run([*self.client, *where, *argv], env=self.env(env), capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)

    def wait_job(self, job: str, timeout: float = 300) -> str:
        """Wait until ``job`` has left the queue; its final state (from scontrol, kept MinJobAge seconds)."""
        end = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < end:
            out = self.run(["scontrol", "-o", "show", "job", job]).stdout
            state = next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "GONE")
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"):
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job} still {state} after {timeout:g} s")

    def stop(self) -> None:
        """Cancel what runs, stop the daemons (slurmd first), remove nothing (the logs stay for a failure)."""
        subprocess.run([*self.client, "scancel", "--full", "-u", "root"], env=self.env(), capture_output=True,
                       timeout=30)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                _signal(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _signal(proc, signal.SIGKILL)
                    proc.wait()
        self._sweep()

    def _sweep(self) -> None:
        """SIGKILL what the daemons started and left (slurmstepd and its tasks outlive a stopped slurmd): every
        process of this host whose environment names this cluster's slurm.conf."""
        mark = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                try:
                    if mark in (proc / "environ").read_bytes().split(b"\0"):
                        os.kill(int(proc.name), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    why = missing()
    if why:
        raise SystemExit(why)
    with SlurmCluster() as cluster:
        result = cluster.run(sys.argv[1:])
        sys.stdout.write(result.stdout + result.stderr)
        sys.exit(result.returncode)
