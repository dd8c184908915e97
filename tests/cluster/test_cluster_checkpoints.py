"""Checkpoints on hosts without a shared filesystem (issue 23): 2 hosts x 2 ranks under mpiexec save to
``/tmp/<dir>``, which is each host's own disk (the cluster's /tmp is private per host), with
tests/workers/checkpoint.py (SGD momentum and Adam, a 42k-parameter MLP, 3 steps at ZeRO stage 2).

- each host holds its own ranks' shards and the same manifest (read from outside through ``hosts[h].tmp``);
- the same hosts resume at stage 0 (every rank needs every shard: the ones its host lacks are sent by the
  other host), train to step 8 and end at the weights of one uninterrupted process (independent reference);
- h1 alone, with only its own directory, fails on every rank with CheckpointMissingError naming h2's shards,
  the ranks that wrote them, where, and how to fix it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fakehosts import Cluster
from jobs import LAUNCHES, run_job

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "checkpoint.py")
CKPT = "/tmp/unidist-ckpt-hosts"  # the same path on every host, a different disk on each
TOL = {"sgd": 1e-5, "adam": 1e-4}


@pytest.mark.mpi
def test_per_host_directories_save_resume_and_name_what_is_missing(cluster2: Cluster) -> None:
    launch, env = LAUNCHES["mpiexec"], {"UNIDIST_TIMEOUT": "30"}
    out = cluster2.shared / "ckpt-hosts-out"
    out.mkdir()
    local = {h: cluster2.hosts[h].tmp / Path(CKPT).name for h in ("h1", "h2")}
    try:
        job = run_job(cluster2, launch, {"h1": 2, "h2": 2}, [WORKER, "--phase", "save", "--stage", "2", "--dir", CKPT],
                      env, timeout=120)
        assert job.code == 0, job.output[-6000:]
        for name in TOL:
            files = {h: sorted(p.name for p in (d / name / "step-3").iterdir()) for h, d in local.items()}
            assert files == {h: ["manifest.json", "meta.pt", *(f"shard-0000{r}-of-00004.pt" for r in ranks)]
                             for h, ranks in (("h1", (0, 1)), ("h2", (2, 3)))}, files
            manifests = [(d / name / "step-3" / "manifest.json").read_text() for d in local.values()]
            assert manifests[0] == manifests[1]
            storage = json.loads(manifests[0])["storage"]
            assert [(s["hosts"], s["ranks"], s["path"]) for s in storage] == [
                (["h1"], [0, 1], f"{CKPT}/{name}/step-3"), (["h2"], [2, 3], f"{CKPT}/{name}/step-3")]
        save_s = job.seconds

        job = run_job(cluster2, launch, {"h1": 2, "h2": 2}, [
            WORKER, "--phase", "resume", "--stage", "0", "--dir", CKPT, "--out", str(out)], env, timeout=120)
        assert job.code == 0, job.output[-6000:]
        for rank in range(4):
            rep = json.loads((out / f"rank{rank}.json").read_text())
            assert (rep["backend"], rep["size"]) == ("mpi", 4), rep
            for name, tol in TOL.items():
                assert rep[name]["resumed_from"] == 3 and rep[name]["diff"] <= tol, (rank, name, rep[name])
                assert rep[name]["spread"] == 0.0, (rank, name, rep[name])
        resume_s = job.seconds

        job = run_job(cluster2, launch, {"h1": 2}, [WORKER, "--phase", "resume", "--dir", CKPT, "--out", str(out)],
                      env, timeout=120)
        assert job.code not in (0, None), job.output[-6000:]
        text = " ".join(job.output.split())
        want = (f"CheckpointMissingError: {CKPT}/sgd/step-3: no host of this job has shard-00002-of-00004.pt, "
                f"shard-00003-of-00004.pt (written by ranks 2, 3 on h2 into its {CKPT}/sgd/step-3). The checkpoint "
                "was saved on hosts without a shared filesystem")
        assert text.count(want) == 2, job.output[-6000:]  # both ranks, each its own line
        assert "this job runs on h1 (ranks 0, 1)" in text, job.output[-6000:]
        assert f"rsync -a h2:{CKPT}/sgd/step-3/ {CKPT}/sgd/step-3/" in text, job.output[-6000:]
        print(f"save {save_s:.1f} s, resume {resume_s:.1f} s, refused on 1 host {job.seconds:.1f} s")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        for d in local.values():
            shutil.rmtree(d, ignore_errors=True)
