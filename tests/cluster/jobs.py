"""How a job is started on the simulated cluster, one row per launcher form (issue 23), and running one.

A row turns ``{host: ranks}`` and a script's argv into the processes to start: one (host, argv) for launchers
that reach the other hosts themselves (mpiexec over the ssh stand-in, horovodrun -H, deepspeed's runner over
pdsh, ``unidist launch``), one per host for those started on every node (torchrun, ``deepspeed --no_ssh``, an
srun stand-in). Every process runs inside its host; the job's exit code is the worst of theirs.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from fakehosts import Cluster
from hostlist import compress, tasks_per_node

Hosts = Mapping[str, int]  # host name -> ranks on it, in order: the first host is the "login node"
Starts = list[tuple[str, list[str]]]  # (host, argv) per process to start


def _mpiexec(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    spec = ",".join(f"{h}:{n}" for h, n in hosts.items())
    first = next(iter(hosts))
    return [(first, ["mpiexec", "-launcher", "ssh", "-launcher-exec", str(cluster.bin / "ssh"), "-hosts", spec,
                     "-n", str(sum(hosts.values())), sys.executable, *argv])]


_PORTS = itertools.count(29400 + os.getpid() % 500 * 20)  # rendezvous ports: one per job, never reused by a run


def _each_host(hosts: Hosts, launcher: Callable[[int, str, int], list[str]]) -> Starts:
    return [(host, launcher(i, host, n)) for i, (host, n) in enumerate(hosts.items())]


def _torchrun_static(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    first, port = next(iter(hosts)), next(_PORTS)
    return _each_host(hosts, lambda i, _, n: [
        "torchrun", "--nnodes", str(len(hosts)), "--node_rank", str(i), "--master_addr", first, "--master_port",
        str(port), "--nproc_per_node", str(n), *argv])


def _torchrun_c10d(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    first, port = next(iter(hosts)), next(_PORTS)  # c10d numbers the nodes by sorted host name: h1 first
    return _each_host(hosts, lambda i, _, n: [
        "torchrun", "--nnodes", str(len(hosts)), "--nproc_per_node", str(n), "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"{first}:{port}", "--rdzv_id", f"job{port}", *argv])


def _horovodrun(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    spec = ",".join(f"{h}:{n}" for h, n in hosts.items())
    return [(next(iter(hosts)), ["horovodrun", "-np", str(sum(hosts.values())), "-H", spec, "--gloo",
                                 sys.executable, *argv])]


def _hostfile(cluster: Cluster, hosts: Hosts, port: int) -> str:
    path = cluster.shared / f"hostfile-{port}"  # DeepSpeed's format; on the shared filesystem, as users keep it
    path.write_text("".join(f"{h} slots={n}\n" for h, n in hosts.items()))
    return str(path)


def _deepspeed_pdsh(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    """DeepSpeed's own multinode runner (pdsh over ssh); no --master_addr: it asks the first host `hostname -I`.
    The runner carries only a few variables (PYTHON*, UCX*, MV2*...) to the nodes, and the others a user puts in
    a ``.deepspeed_env`` file: the job's UNIDIST_* variables are written to one (DS_ENV_FILE names it)."""
    port = next(_PORTS)
    env_file = cluster.shared / f"deepspeed_env-{port}"
    return [(next(iter(hosts)), ["sh", "-c", 'env | grep "^UNIDIST_" > "$0"; DS_ENV_FILE="$0" exec deepspeed "$@"',
                                 str(env_file), "--hostfile", _hostfile(cluster, hosts, port), "--master_port",
                                 str(port), *argv])]


def _deepspeed_no_ssh(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    first, port = next(iter(hosts)), next(_PORTS)
    hostfile = _hostfile(cluster, hosts, port)
    return _each_host(hosts, lambda i, _, n: [
        "deepspeed", "--hostfile", hostfile, "--no_ssh", "--node_rank", str(i), "--master_addr", first,
        "--master_port", str(port), *argv])


def _unidist_launch_deepspeed(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    """``unidist launch --hostfile F --backend deepspeed`` on the first host, as a user types it: one ``deepspeed
    --no_ssh --node_rank i`` per host over ssh (unidist's LAUNCHERS row), no pdsh; the job's variables carried."""
    hostfile = _hostfile(cluster, hosts, next(_PORTS))
    return [(next(iter(hosts)), [sys.executable, "-m", "unidist.cli", "launch", "--hostfile", hostfile, "--backend",
                                 "deepspeed", *argv])]


def allocation(hosts: Hosts, port: int) -> list[str]:
    """``env`` words for the variables sbatch gives a batch script on the first host of an allocation of
    ``hosts``, and the MASTER_PORT launch_scripts/slurm.sbatch exports."""
    counts = list(hosts.values())
    nodes = compress(list(hosts))  # sbatch sets both spellings; Hydra reads SLURM_NNODES, SLURM_NODELIST
    allocation = {"SLURM_JOB_ID": str(port), "SLURM_JOBID": str(port), "SLURM_JOB_NODELIST": nodes,
                  "SLURM_NODELIST": nodes, "SLURM_JOB_NUM_NODES": str(len(hosts)), "SLURM_NNODES": str(len(hosts)),
                  "SLURM_NTASKS": str(sum(counts)), "SLURM_NPROCS": str(sum(counts)),
                  "SLURM_TASKS_PER_NODE": tasks_per_node(counts), "MASTER_PORT": str(port)}
    if len(set(counts)) == 1:
        allocation["SLURM_NTASKS_PER_NODE"] = str(counts[0])
    return ["env", *(f"{k}={v}" for k, v in allocation.items())]


def _srun(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    """``srun`` in an allocation of the hosts, as launch_scripts/slurm.sbatch runs it (the srun stand-in)."""
    return [(next(iter(hosts)), [*allocation(hosts, next(_PORTS)), "srun", "--kill-on-bad-exit=1",
                                 sys.executable, *argv])]


def _mpiexec_in_allocation(cluster: Cluster, hosts: Hosts, argv: Sequence[str]) -> Starts:
    """Plain ``mpiexec -n N`` in an allocation: Hydra reads the hosts from Slurm's variables and starts its
    proxies with ``srun -N 2 -n 2 --input none hydra_pmi_proxy ... --proxy-id -1`` (the srun stand-in)."""
    return [(next(iter(hosts)), [*allocation(hosts, next(_PORTS)), "mpiexec", "-n", str(sum(hosts.values())),
                                 sys.executable, *argv])]


@dataclass(frozen=True)
class ClusterLaunch:
    """One launcher form on several hosts: the backend init() must pick (also the pytest mark), the engines
    it needs, extra environment, and how it starts."""

    name: str
    backend: str
    start: Callable[[Cluster, Hosts, Sequence[str]], Starts]
    engines: tuple[str, ...] = ("torch",)
    env: dict[str, str] = field(default_factory=dict)

    def param(self, *more: object, marks: Sequence[pytest.MarkDecorator] = ()) -> object:
        """A pytest param of this launch (id: its name), marked with its backend."""
        return pytest.param(self, *more, id=self.name, marks=[getattr(pytest.mark, self.backend), *marks])


LAUNCHES = {launch.name: launch for launch in [
    ClusterLaunch("mpiexec", "mpi", _mpiexec, ("torch", "mpi4py")),
    ClusterLaunch("torch-under-mpiexec", "torch", _mpiexec, ("torch", "mpi4py"), {"UNIDIST_BACKEND": "torch"}),
    ClusterLaunch("horovod-under-mpiexec", "horovod", _mpiexec, ("torch", "mpi4py", "horovod"),
                  {"UNIDIST_BACKEND": "horovod"}),
    ClusterLaunch("torchrun-static", "torch", _torchrun_static),
    ClusterLaunch("torchrun-c10d", "torch", _torchrun_c10d),
    ClusterLaunch("horovodrun-gloo", "horovod", _horovodrun, ("torch", "horovod")),
    ClusterLaunch("deepspeed-pdsh", "deepspeed", _deepspeed_pdsh, ("torch", "deepspeed")),
    ClusterLaunch("deepspeed-no-ssh", "deepspeed", _deepspeed_no_ssh, ("torch", "deepspeed")),
    ClusterLaunch("unidist-launch-deepspeed", "deepspeed", _unidist_launch_deepspeed, ("torch", "deepspeed")),
    # srun without PMI (none is simulated): the MPI backend a Slurm step implies cannot start here
    ClusterLaunch("srun-torch", "torch", _srun, ("torch",), {"UNIDIST_BACKEND": "torch"}),
    ClusterLaunch("mpiexec-in-allocation", "mpi", _mpiexec_in_allocation, ("torch", "mpi4py")),
]}


@dataclass
class Job:
    codes: list[int | None]  # per started process; None: killed at the timeout
    output: str  # every process's stdout and stderr, each block headed by its host
    seconds: float

    @property
    def code(self) -> int | None:
        """The job's exit code: the first non-zero one (None if any process had to be killed)."""
        if None in self.codes:
            return None
        return next((c for c in self.codes if c), 0)


def run_job(cluster: Cluster, launch: ClusterLaunch, hosts: Hosts, argv: Sequence[str],
            env: Mapping[str, str] | None = None, timeout: float = 300) -> Job:
    """Start ``argv`` (a script and its arguments) on ``hosts`` with ``launch``; wait for every process (or
    ``timeout``, then kill every process on every host the job touched)."""
    from helpers import require

    require(*launch.engines)
    logs = []
    procs = []
    t0 = time.monotonic()
    for host, cmd in launch.start(cluster, hosts, argv):
        log = cluster.shared / f"job-{os.getpid()}-{len(logs)}-{host}.log"
        sink = open(log, "w")
        logs.append((host, log, sink))
        procs.append(cluster.popen(host, cmd, {**launch.env, **(env or {})}, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL))
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            codes.append(None)
    seconds = time.monotonic() - t0
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if None in codes:
        for host in hosts:
            cluster.kill_all(host)
    text = []
    for host, log, sink in logs:
        sink.close()
        text.append(f"===== {host}: {log.name}\n{log.read_text()}")
        log.unlink()
    return Job(codes, "\n".join(text), seconds)
