"""``unidist launch --hosts h1:2,h2:2`` run on h1 as a user would: the mpi backend (mpiexec over ssh) and the
torch backend (torchrun on each host over ssh, one c10d rendezvous) start the topology worker on both hosts;
the torch job then fails on h2, and its exit code passes through with h1's processes ended (issue 23 part 4).
One launch per backend: ~15 s (mpi) and ~40 s (torch, its failure included) on a loaded 2-core machine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakehosts import Cluster

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
    print(f"unidist launch --hosts h1:2,h2:2 --backend {backend}: exit {proc.returncode} in {seconds:.1f} s",
          file=sys.stderr)
    return proc, seconds


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
    left = [line for host in HOSTS for line in cluster2.processes(host).splitlines() if script.name in line]
    assert not left, left
