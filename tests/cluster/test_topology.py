"""Every launcher form on 2 hosts x 2 ranks: the topology each rank is told (rank, local rank and size, node
rank, host), one allreduce against numpy, and what every rank listens on: only its host's cluster address or
loopback, besides the sockets it inherited from its launcher, which are listed, not hidden (issue 23)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from fakehosts import Cluster
from jobs import LAUNCHES, ClusterLaunch, run_job

WORKER = str(Path(__file__).resolve().parent / "workers" / "topology.py")
HOSTS = {"h1": 2, "h2": 2}


# One form per engine: what a rank listens on is the engine's doing (MPI's UCX, gloo's pairs, Horovod's
# controller), not the launcher form's. Every other form's topology is checked by its README recipe, which runs
# hello_collectives (rank, local rank and node of the 4 ranks, and 7 collectives; test_readme_cluster.py); a
# form with no recipe is checked here. FULL_MATRIX=1 runs every form (10 jobs, ~4 minutes).
PER_ENGINE = ("mpiexec", "torchrun-static", "horovod-under-mpiexec", "deepspeed-pdsh")
FORMS = [launch.param() for name, launch in LAUNCHES.items()
         if name in PER_ENGINE or os.environ.get("FULL_MATRIX") == "1"]


@pytest.mark.parametrize("launch", FORMS)
def test_topology_and_listening_sockets(cluster2: Cluster, launch: ClusterLaunch) -> None:
    out = cluster2.shared / f"topology-{launch.name}.json"
    job = run_job(cluster2, launch, HOSTS, [WORKER, str(out)], {"UNIDIST_TIMEOUT": "30"}, timeout=120)
    assert job.code == 0, job.output[-6000:]
    ranks = json.loads(out.read_text())
    expect = [(r, r % 2, 2, r // 2, f"h{r // 2 + 1}") for r in range(4)]
    got = [(x["rank"], x["local_rank"], x["local_size"], x["node_rank"], x["host"]) for x in ranks]
    assert got == expect, got
    assert all(x["backend"] == launch.backend and x["size"] == 4 for x in ranks), ranks
    assert all(x["sum"] == [10.0] * 3 for x in ranks), ranks  # 1 + 2 + 3 + 4, over the network
    assert all(x["timeout"] == 30 for x in ranks), ranks  # the job's environment reached the far host's ranks
    for x in ranks:
        mine = {"127.0.0.1", "::1", cluster2.hosts[x["host"]].address}
        stray = [a for a in x["listen"] if a[0] not in mine and a not in x["inherited"]]
        assert not stray, f"rank {x['rank']} listens on {stray} (own: {mine}; inherited {x['inherited']})"
    inherited = sorted({tuple(a) for x in ranks for a in x["inherited"]})
    print(f"{launch.name}: inherited listening sockets (the launcher's own): {inherited}", file=sys.stderr)


def test_cluster_bench_runs(cluster2: Cluster, tmp_path: Path) -> None:
    """benchmarks/RESULTS.md's "Across hosts" command still runs: its mpi sweep at two sizes, each row checked
    by the bench itself (the result against the expected sum) and timed beside mpi4py's own call."""
    from bench_cluster import measure

    report = measure(cluster2, ["mpi"], "8,64K", "allreduce,broadcast", tmp_path)
    assert "failed" not in report, report
    rows = json.loads((tmp_path / "mpi.json").read_text())["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, b) for op in ("allreduce", "broadcast") for b in (8, 65536)]
    assert all(r["time_us"] > 0 and r["raw_time_us"] > 0 for r in rows), rows
