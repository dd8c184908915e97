"""``unidist launch --hosts h1:2,h2:2`` run on h1 as a user would: the mpi backend (mpiexec over ssh), the torch
backend (torchrun on each host over ssh, one c10d rendezvous) and the deepspeed backend (``deepspeed --no_ssh
--node_rank i`` on each host over ssh, its hostfile written on each host) start the topology worker on both
hosts; the torch and deepspeed jobs then fail on h2, and the exit code passes through with h1's processes ended
(issue 23 part 4, issue 37 part 6).

deepspeed runs on hosts with no pdsh at all (not even this machine's own: ``Cluster(pdsh="none")``), where it also
trains like one process (``--hostfile``, tests/workers/equivalence.py, test_suites.py's check), and beside
Debian's real pdsh, which it must not use; DeepSpeed's own runner (``deepspeed --hostfile``, a user's command,
jobs.py's ``deepspeed-pdsh`` row) runs there on the real pdsh. One launch each: ~15 s (mpi), ~40 s (torch, its
failure included) on a loaded 2-core machine; the deepspeed ones print theirs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakehosts import Cluster
from jobs import LAUNCHES, run_job

WORKER = str(Path(__file__).resolve().parent / "workers" / "topology.py")
HOSTS = ["h1", "h2"]
UNIDIST = [sys.executable, "-m", "unidist.cli", "launch", "--hosts", "h1:2,h2:2"]
# the topology worker, then rank 3 (on h2) exits 3 while the others would sleep: the launcher must end them
THEN_FAIL = f"""import os, runpy, sys, time
runpy.run_path({WORKER!r}, run_name="__main__")
sys.stdout.flush()
if os.environ["RANK"] == "3":
    sys.exit(3)
time.sleep(120)
"""


def _launch(cluster: Cluster, backend: str, argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = cluster.run("h1", [*UNIDIST, "--backend", backend, *argv], {"UNIDIST_TIMEOUT": "30"}, timeout=150)
    seconds = time.monotonic() - t0
    if "[fakehosts: killed" in proc.stderr:
        for host in HOSTS:
            cluster.kill_all(host)
    pdsh = f" (pdsh: {cluster.pdsh})" if backend == "deepspeed" else ""
    print(f"unidist launch --hosts h1:2,h2:2 --backend {backend}{pdsh}: exit {proc.returncode} in {seconds:.1f} s",
          file=sys.stderr)
    return proc, seconds


def _left(cluster: Cluster, word: str) -> list[str]:
    """What still runs on any host with ``word`` in its command line."""
    return [line for host in HOSTS for line in cluster.processes(host).splitlines() if word in line]


def _check_topology(out: Path, backend: str) -> None:
    ranks = json.loads(out.read_text())
    got = [(x["rank"], x["local_rank"], x["local_size"], x["node_rank"], x["host"]) for x in ranks]
    assert got == [(r, r % 2, 2, r // 2, f"h{r // 2 + 1}") for r in range(4)], got
    assert all(x["backend"] == backend and x["size"] == 4 for x in ranks), ranks
    assert all(x["sum"] == [10.0] * 3 for x in ranks), ranks  # 1 + 2 + 3 + 4, over the network


@pytest.mark.mpi
def test_launch_hosts_mpi(cluster2: Cluster) -> None:
    """mpiexec -launcher ssh -launcher-exec <ssh on PATH> -hosts h1:2,h2:2, from the mpi backend's row."""
    from helpers import require

    require("torch", "mpi4py")
    out = cluster2.shared / "launch-cli-mpi.json"
    proc, _ = _launch(cluster2, "mpi", [WORKER, str(out)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    _check_topology(out, "mpi")


@pytest.mark.torch
def test_launch_hosts_torch_and_failure(cluster2: Cluster) -> None:
    """torchrun over ssh on h1 and h2: the topology, then rank 3 exits 3. torchrun on h2 reports a failed
    worker as 1, which passes through; unidist launch closes h1's ssh session input, whose torchrun then stops
    its ranks (they would sleep 120 s) and nothing of the job is left on either host."""
    from helpers import require

    require("torch")
    out = cluster2.shared / "launch-cli-torch.json"
    script = cluster2.shared / "launch_cli_then_fail.py"
    script.write_text(THEN_FAIL)
    proc, seconds = _launch(cluster2, "torch", [str(script), str(out)])
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-6000:]
    assert "exitcode  : 3" in proc.stderr, proc.stderr[-6000:]  # torchrun's report of rank 3
    _check_topology(out, "torch")
    assert seconds < 100, seconds
    left = _left(cluster2, script.name)
    assert not left, left


def _per_host_runners(output: str) -> None:
    """DeepSpeed's runner says what it starts (``cmd = ...``): on each host its per-node launcher for its own node
    rank, never pdsh."""
    assert "cmd = pdsh" not in output and "PDSHRunner" not in output, output[-6000:]
    for node_rank in (0, 1):
        assert re.search(rf"cmd = \S*python\S* -u -m deepspeed.launcher.launch .*--node_rank={node_rank}", output), \
            output[-6000:]


@pytest.mark.deepspeed
def test_launch_hosts_deepspeed_without_pdsh_and_failure(no_pdsh: Cluster) -> None:
    """No pdsh on any host: one ``deepspeed --no_ssh`` per host over ssh, the topology DeepSpeed's own numbering
    gives (ranks by host order, CROSS_RANK the node), then rank 3 exits 3: h2's runner reports it, the code passes
    through, and h1's session is closed, which stops its runner's whole process group (DeepSpeed's runner itself
    does not pass SIGTERM on to its per-node launcher and ranks)."""
    from helpers import require

    require("torch", "deepspeed")
    assert [no_pdsh.which(host, "pdsh") for host in HOSTS] == [None, None]
    out = no_pdsh.shared / "launch-cli-deepspeed.json"
    script = no_pdsh.shared / "launch_cli_ds_then_fail.py"
    script.write_text(THEN_FAIL)
    proc, seconds = _launch(no_pdsh, "deepspeed", [str(script), str(out)])
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-6000:]
    _per_host_runners(proc.stdout + proc.stderr)
    _check_topology(out, "deepspeed")
    assert all(x["timeout"] == 30 for x in json.loads(out.read_text())), out.read_text()  # carried over ssh
    assert seconds < 100, seconds
    assert not _left(no_pdsh, script.name), _left(no_pdsh, script.name)


@pytest.mark.deepspeed
def test_launch_hostfile_deepspeed_trains_without_pdsh(no_pdsh: Cluster) -> None:
    """``unidist launch --hostfile F --backend deepspeed`` (jobs.py's row) on hosts without pdsh: DeepSpeed's engine
    across the hosts trains like one process on the whole batch (test_suites.py's equivalence check: its 7
    variants, one DeepSpeed engine each)."""
    from helpers import assert_trains_like_one_process
    from test_suites import TOLERANCE, launch_worker

    res = launch_worker(no_pdsh, LAUNCHES["unidist-launch-deepspeed"], "equivalence-no-pdsh", "equivalence.py",
                        "--variants", ",".join(TOLERANCE))
    assert_trains_like_one_process(res, "deepspeed", TOLERANCE)


@pytest.mark.deepspeed
def test_launch_hosts_deepspeed_beside_real_pdsh(real_pdsh: Cluster) -> None:
    """With Debian's pdsh on every host, unidist launch still starts DeepSpeed per host (pdsh is never asked)."""
    from helpers import require

    require("torch", "deepspeed")
    assert [real_pdsh.which(host, "pdsh") for host in HOSTS] == [shutil.which("pdsh")] * 2
    out = real_pdsh.shared / "launch-cli-deepspeed-pdsh.json"
    proc, _ = _launch(real_pdsh, "deepspeed", [WORKER, str(out)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    _per_host_runners(proc.stdout + proc.stderr)
    _check_topology(out, "deepspeed")


@pytest.mark.deepspeed
def test_deepspeeds_own_runner_on_real_pdsh(real_pdsh: Cluster) -> None:
    """A user's own ``deepspeed --hostfile F script`` (DeepSpeed's runner: pdsh -R ssh, jobs.py's ``deepspeed-pdsh``
    row) on Debian's pdsh, not the stand-in: the same topology, and the job's variables reach h2 (.deepspeed_env)."""
    launch = LAUNCHES["deepspeed-pdsh"]
    assert not (real_pdsh.bin / "pdsh").exists() and real_pdsh.which("h1", "pdsh") == shutil.which("pdsh")
    out = real_pdsh.shared / "deepspeed-runner-real-pdsh.json"
    job = run_job(real_pdsh, launch, {"h1": 2, "h2": 2}, [WORKER, str(out)], {"UNIDIST_TIMEOUT": "30"}, timeout=150)
    print(f"deepspeed --hostfile (real pdsh): exit {job.code} in {job.seconds:.1f} s", file=sys.stderr)
    assert job.code == 0, job.output[-6000:]
    assert "cmd = pdsh" in job.output, job.output[-6000:]
    _check_topology(out, "deepspeed")
    assert all(x["timeout"] == 30 for x in json.loads(out.read_text())), out.read_text()
