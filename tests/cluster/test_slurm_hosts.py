"""A real Slurm across simulated hosts (issue 27): slurmctld and a slurmd inside h1, a slurmd inside h2 (CPUs=2
each), one munged here whose socket, under /var/tmp, every host reaches; ``srun --nodes=2 --ntasks=4`` from h1.

Every backend in both of Slurm's modes a user meets: ``--mpi=pmi2`` (every backend meets over MPI's PMI, served
by the slurmstepds) and ``--mpi=none`` (Debian's MpiDefault: torch, deepspeed and horovod meet at the step's
first node on a port derived from the job and step ids; mpi refuses at once and says to use --mpi=pmi2). Each
rank's host, node rank, local rank and size, the world size and one allreduce are checked (the topology worker
of test_topology.py); one training equivalence launch each for torch without PMI and mpi over PMI2. Each launch
prints its seconds, and the module prints them all at the end.

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``.ci/install_slurm.sh``): skipped with the reason where
either is missing, failed instead under REQUIRE_CLUSTER=1 when Slurm is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakehosts import Cluster, ClusterUnavailableError, sweep, why_unavailable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "slurm"))

from helpers import MARKS, assert_trains_like_one_process, require
from slurmcluster import CLIENTS, DAEMONS, SlurmCluster, missing

TESTS = Path(__file__).resolve().parents[1]
TOPOLOGY = str(TESTS / "cluster" / "workers" / "topology.py")
EQUIVALENCE = str(TESTS / "workers" / "equivalence.py")
CPUS = 2  # per simulated host, as this machine has (the hosts share its cores)
ENV = {"UNIDIST_TIMEOUT": "60", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
ENGINES = {"mpi": ("torch", "mpi4py"), "torch": ("torch",), "deepspeed": ("torch", "deepspeed"),
           "horovod": ("torch", "horovod")}
# mpi without PMI has no MPI world: it must say so (and how to get one) at start, not hang
NO_PMI_WORDS = ("without PMI", "--mpi=pmi2")
NO_PMI_SECONDS = 20


def _installed() -> bool:
    path = os.environ.get("PATH", "") + ":/usr/sbin"
    return all(shutil.which(p, path=path) for p in (*DAEMONS, *CLIENTS))


def _cgroup_mounts() -> str:
    """Shell commands that mount in a host what this machine has under /sys/fs/cgroup: ``ip netns exec`` put a
    fresh sysfs over the hosts' /sys, and slurmd 22.05 will not start without a cgroup filesystem to detect (its
    cgroup plugin is loaded even with proctrack/linuxproc and task/none; nothing is confined)."""
    cmds = []
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            src, target, fstype, opts = line.split()[:4]
            if target == "/sys/fs/cgroup" or target.startswith("/sys/fs/cgroup/"):
                cmds.append(f"mkdir -p {target} && mount -t {fstype} -o {opts} {src} {target}")
    return " && ".join(cmds) or "true"


@dataclass
class SlurmHosts:
    """The simulated hosts and the Slurm running on them; ``seconds``: each launch's, by test."""

    cluster: Cluster
    slurm: SlurmCluster
    seconds: dict[str, float] = field(default_factory=dict)

    def srun(self, label: str, argv: list[str], env: Mapping[str, str], timeout: float = 180,
             ) -> tuple[subprocess.CompletedProcess[str], float]:
        """``srun argv`` on h1 (the login node), output captured; the seconds it took are recorded under
        ``label``. The real srun by its path: the hosts' PATH starts with the fakehosts srun stand-in."""
        srun = shutil.which("srun", path=self.slurm.env()["PATH"])
        assert srun, "srun not found"
        t0 = time.monotonic()
        done = self.cluster.run("h1", [srun, "--kill-on-bad-exit=1", *argv],
                                {**ENV, **env, "SLURM_CONF": str(self.slurm.conf)}, timeout=timeout)
        seconds = time.monotonic() - t0
        if done.returncode != 0 or seconds >= timeout:
            self.slurm.run(["scancel", "--full", "-u", "root"], timeout=30)  # nothing left for the next launch
        self.seconds[label] = seconds
        print(f"{label}: {seconds:.1f} s (exit {done.returncode})")
        return done, seconds


def _stopped(cluster: Cluster, seconds: float = 15) -> None:
    """Wait until no Slurm daemon or step is alive on any host (zombies aside: a host's init reaps none)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        alive = [line for h in cluster.hosts for line in cluster.processes(h).splitlines()[1:]
                 if "slurm" in line and not line.split()[1].startswith("Z")]
        if not alive:
            return
        time.sleep(0.3)


@pytest.fixture(scope="module")
def slurm_hosts() -> Iterator[SlurmHosts]:
    reasons = [r for r in (missing(), why_unavailable()) if r]
    if reasons:
        if os.environ.get("REQUIRE_CLUSTER") == "1" and _installed():
            pytest.fail(f"{'; '.join(reasons)}, but REQUIRE_CLUSTER=1 requires Slurm on the simulated cluster")
        pytest.skip("; ".join(reasons))
    sweep()
    try:
        cluster = Cluster(2).up()
    except ClusterUnavailableError as err:
        if os.environ.get("REQUIRE_CLUSTER") == "1":
            pytest.fail(f"the simulated cluster would not start: {err}")
        pytest.skip(str(err))
    for name in cluster.hosts:
        mounted = cluster.run(name, ["sh", "-c", _cgroup_mounts()], timeout=30)
        if mounted.returncode != 0:
            cluster.down()
            pytest.fail(f"cannot mount the cgroup filesystems on {name}: {mounted.stderr}")

    def run_on(node: str, argv: list[str], log: Path) -> subprocess.Popen[Any]:
        with open(log, "ab") as sink:
            return cluster.popen(node, argv, {"SLURM_CONF": str(slurm.conf)}, stdout=sink, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)

    nodes = {name: (host.address, CPUS) for name, host in cluster.hosts.items()}
    slurm = SlurmCluster(cluster.dir / "slurm", nodes, run_on, ("h1", nodes["h1"][0]), cluster.enter("h1"))
    state = SlurmHosts(cluster, slurm)
    try:
        t0 = time.monotonic()
        try:
            slurm.start()
        except RuntimeError as err:
            pytest.fail(f"Slurm would not start on the simulated hosts: {err}")
        print(f"\nSlurm on h1, h2 up in {time.monotonic() - t0:.1f} s")
        yield state
    finally:
        slurm.stop()
        _stopped(cluster)
        cluster.down()
        if state.seconds:
            print("\nseconds per launch:\n" + "\n".join(f"  {k:<32} {v:6.1f}" for k, v in state.seconds.items()))


STEP = ["--nodes=2", "--ntasks=4", "--ntasks-per-node=2"]
PMI2_GARBLED = "mpi/pmi2: value not properly terminated in client request"  # slurmstepd's words
CASES = [pytest.param(b, m, marks=MARKS[b], id=f"{b}-{m}")
         for b in ("mpi", "torch", "deepspeed", "horovod") for m in ("pmi2", "none") if (b, m) != ("mpi", "none")]


@pytest.mark.parametrize(("backend", "mpi"), CASES)
def test_topology_across_hosts(slurm_hosts: SlurmHosts, backend: str, mpi: str) -> None:
    """Ranks 0, 1 on h1 and 2, 3 on h2, each told its place, and one allreduce between the hosts."""
    require(*ENGINES[backend])
    out = slurm_hosts.cluster.shared / f"topology-{backend}-{mpi}.json"
    argv, env = [*STEP, f"--mpi={mpi}", sys.executable, TOPOLOGY, str(out)], {"UNIDIST_BACKEND": backend}
    done, _ = slurm_hosts.srun(f"topology {backend} --mpi={mpi}", argv, env)
    if done.returncode != 0 and PMI2_GARBLED in done.stderr:
        # seen once (2026-11-29 dry run, horovod-pmi2, machine under a full test load; 0 of 3 alone): slurmstepd got
        # binary bytes on a rank's PMI2 socket, the UCX address exchange failed, and the step was cancelled. It is
        # the PMI2 channel between mpich and slurmstepd, before any unidist collective: once more, said, then fail
        warnings.warn(f"srun's PMI2 channel carried garbled requests ({PMI2_GARBLED!r}); ran the step again",
                      stacklevel=1)
        done, _ = slurm_hosts.srun(f"topology {backend} --mpi={mpi} (again)", argv, env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = json.loads(out.read_text())
    got = [(x["rank"], x["local_rank"], x["local_size"], x["node_rank"], x["host"], x["size"], x["backend"])
           for x in ranks]
    assert got == [(r, r % 2, 2, r // 2, f"h{r // 2 + 1}", 4, backend) for r in range(4)], got
    assert all(x["sum"] == [10.0] * 3 for x in ranks), ranks  # 1 + 2 + 3 + 4, between the hosts
    for x in ranks:  # as test_topology.py: only the host's own cluster address or loopback
        mine = {"127.0.0.1", "::1", slurm_hosts.cluster.hosts[x["host"]].address}
        stray = [a for a in x["listen"] if a[0] not in mine and a not in x["inherited"]]
        assert not stray, f"rank {x['rank']} listens on {stray} (own: {mine}; inherited {x['inherited']})"


@MARKS["mpi"]
def test_mpi_without_pmi_says_so(slurm_hosts: SlurmHosts) -> None:
    """``--mpi=none``: no MPI world; every task stops at once with the typed error naming the cure."""
    require(*ENGINES["mpi"])
    out = slurm_hosts.cluster.shared / "topology-mpi-none.json"
    done, seconds = slurm_hosts.srun("topology mpi --mpi=none (refused)",
                                     [*STEP, "--mpi=none", sys.executable, TOPOLOGY, str(out)],
                                     {"UNIDIST_BACKEND": "mpi"}, timeout=NO_PMI_SECONDS * 2)
    text = done.stdout + done.stderr
    assert done.returncode != 0 and not out.exists(), text[-6000:]
    assert all(w in text for w in NO_PMI_WORDS), text[-6000:]
    assert "LaunchEnvironmentError" in text, text[-6000:]
    assert seconds < NO_PMI_SECONDS, f"took {seconds:.1f} s to refuse"


# tests/cluster/test_suites.py's tolerances for these variants (float32 to rounding; Adam clipped)
TOLERANCE = {"k2": 1e-5, "adam_clip": 1e-4}


@pytest.mark.parametrize(("backend", "mpi"), [pytest.param("torch", "none", marks=MARKS["torch"], id="torch-none"),
                                              pytest.param("mpi", "pmi2", marks=MARKS["mpi"], id="mpi-pmi2")])
def test_equivalence_across_hosts(slurm_hosts: SlurmHosts, backend: str, mpi: str) -> None:
    """Data-parallel training over 2 hosts x 2 ranks equals single-process torch on the whole batch."""
    require(*ENGINES[backend])
    out = slurm_hosts.cluster.shared / f"equivalence-{backend}-{mpi}"
    out.mkdir(parents=True, exist_ok=True)
    done, _ = slurm_hosts.srun(f"equivalence {backend} --mpi={mpi}",
                               [*STEP, f"--mpi={mpi}", sys.executable, EQUIVALENCE, "--variants", ",".join(TOLERANCE),
                                "--out", str(out)], {"UNIDIST_BACKEND": backend})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)
               if (out / f"rank{r}.json").exists()}
    assert sorted(reports) == [0, 1, 2, 3], (done.stdout + done.stderr)[-6000:]
    assert_trains_like_one_process(reports, backend, TOLERANCE)  # parameters identical on both hosts
