"""hvd.elastic under real launchers: a rank dies mid-epoch and the job resumes from its last commit.

tests/workers/hvd_elastic.py trains an SGD-momentum and an Adam model in one TorchState on 2 ranks (3 epochs
of 8 steps, an ElasticSampler, a commit every 3 steps written to disk: UNIDIST_ELASTIC_COMMIT_SECONDS=0);
rank 1 calls os._exit(1) after step 11 on the first attempt only. Under ``torchrun --max-restarts 1`` the
job restarts itself; under mpiexec (which kills rank 0 by SIGKILL before it can say anything: rank 0's watcher
names the last commit) the first launch fails and the same command run again on 3 ranks resumes from the
default commit directory (the job's name does not depend on the world size). Both end with the weights of the
uninterrupted run (simulated in this process with plain torch: 0.0 here, 1e-6 allowed), redo exactly the steps
since the last commit (step 9), process every sample of every epoch once, and leave no commit behind (the
default commit directory, under TMPDIR). The Horovod page's worked example runs as written at the end.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from docsource import commands, output_matches, runnable
from helpers import LAUNCHES, MARKS, ROOT, WORKERS, Launch, require, results, run
from hvd_elastic import BATCH, EPOCHS, N, simulate

WORKER = str(WORKERS / "hvd_elastic.py")
CRASH_AT, EVERY = 11, 3
LAST_COMMIT = CRASH_AT - CRASH_AT % EVERY  # 9


def _env(tmp_path: Path, launch: Launch) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)  # the default commit directory goes under it
    return {**launch.env, "TMPDIR": str(tmp_path / "tmp")}


def _commits(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").glob(f"unidist-elastic-{os.getuid()}/*/commit-*"))


def _runs(out: Path, rank: int) -> list[list[dict[str, Any]]]:
    """Rank ``rank``'s logged steps, one list per process that ran (in order)."""
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for line in (out / f"log-rank{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        runs.setdefault((rec["attempt"], rec["pid"]), []).append(rec)
    return list(runs.values())


def _check(out: Path) -> None:
    ref = simulate(2)
    res = results(out, 2)
    assert sorted(res) == [0, 1]
    for rank, rep in res.items():
        for name, weights in ref.items():
            worst = max(float((torch.tensor(rep["weights"][name][k]) - torch.tensor(w)).abs().max())  # type: ignore[index]
                        for k, w in weights.items())
            assert worst <= 1e-6, (rank, name, worst)
        assert rep["steps"] == EPOCHS * N // (2 * BATCH)
        assert rep["resets"] == [2], rep["resets"]  # the reset callbacks ran once, on the resume
    first, second = _runs(out, 1)
    assert [r["step"] for r in first] == list(range(1, CRASH_AT + 1))
    assert second[0]["step"] == LAST_COMMIT + 1
    redone = [r["step"] for r in first if r["step"] > LAST_COMMIT]
    assert len(redone) == CRASH_AT - LAST_COMMIT == 2
    # the samples the job's result stands on: the first run up to its last commit, then the second run
    for epoch in range(EPOCHS):
        seen: list[int] = []
        for rank in (0, 1):
            a, b = _runs(out, rank)
            seen += [i for r in a if r["step"] <= LAST_COMMIT and r["epoch"] == epoch for i in r["indices"]]
            seen += [i for r in b if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(seen) == list(range(N)), (epoch, sorted(seen))


@pytest.mark.parametrize("launch", [pytest.param("torchrun-2", marks=MARKS["torch"])])
def test_torchrun_restarts_and_resumes(tmp_path: Path, launch: str) -> None:
    lch = LAUNCHES[launch]
    require(*lch.engines)
    out = tmp_path / "out"
    out.mkdir()
    argv = lch.command(WORKER, "--out", str(out), "--crash-at", str(CRASH_AT), "--crash-marker",
                       str(tmp_path / "crashed"))
    argv.insert(argv.index("--nproc_per_node"), "--max-restarts")
    argv.insert(argv.index("--nproc_per_node"), "1")
    proc = run(argv, env=_env(tmp_path, lch), timeout=300)
    assert proc.returncode == 0, proc.describe()
    assert "HorovodInternalError" in proc.stderr or "exitcode" in proc.stderr, proc.describe()
    assert re.search(rf"hvd\.elastic: job '\S+': attempt 1 on 2 rank\(s\) resumes: the last commit is \S+/commit-"
                     rf"000000003 \(epoch 1, step {LAST_COMMIT}\), written \d+ s ago by 2 rank\(s\)", proc.stderr), \
        proc.describe()
    assert all(r["attempt"] == 1 for r in results(out, 2).values())
    _check(out)
    assert _commits(tmp_path) == []


@pytest.mark.parametrize(("launch", "bigger"), [pytest.param("mpiexec-2", "mpiexec-3", marks=MARKS["mpi"])])
def test_mpiexec_fails_then_resumes_on_three(tmp_path: Path, launch: str, bigger: str) -> None:
    """The first launch fails, and the watcher of rank 0 (killed by mpiexec) says which commit a rerun resumes
    from; the same command on 3 ranks resumes from it: the sampler re-deals the rest of the epoch over 3, the reset
    callbacks see size 3, and the weights equal the simulated 2-then-3-rank run."""
    lch, large = LAUNCHES[launch], LAUNCHES[bigger]
    require(*lch.engines, *large.engines)
    out = tmp_path / "out"
    out.mkdir()
    args = (WORKER, "--out", str(out), "--crash-at", str(CRASH_AT), "--crash-marker", str(tmp_path / "crashed"))
    first = run(lch.command(*args), env=_env(tmp_path, lch), timeout=300)
    assert first.returncode != 0, first.describe()
    assert f"crashes after step {CRASH_AT}" in first.stdout, first.describe()
    commits = _commits(tmp_path)
    assert [p.name for p in commits] == ["commit-000000002", "commit-000000003"]
    assert re.search(rf"hvd\.elastic: job '(hvd_elastic-\w+)' ended before its training function returned \(rank 0's "
                     rf"process is gone: a lost rank or the launcher ended it\); the last commit is "
                     rf"{re.escape(str(commits[-1]))} \(epoch 1, step {LAST_COMMIT}\), written \d+ s ago by 2 "
                     r"rank\(s\): run the same command again \(any number of processes\) to resume from it",
                     first.stderr), first.describe()

    third = run(large.command(*args), env=_env(tmp_path, large), timeout=300)
    assert third.returncode == 0, third.describe()
    assert f"attempt 0 on 3 rank(s) resumes: the last commit is {commits[-1]} (epoch 1, step {LAST_COMMIT}), " \
        "written" in third.stderr, third.describe()
    ref = simulate(2, LAST_COMMIT, 3)
    res = results(out, 3)
    assert sorted(res) == [0, 1, 2]
    for rank, rep in res.items():
        worst = max(float((torch.tensor(rep["weights"][m][k]) - torch.tensor(w)).abs().max())  # type: ignore[index]
                    for m, weights in ref.items() for k, w in weights.items())
        assert worst <= 1e-6, (rank, worst)
        assert rep["resets"] == [3], rep["resets"]
    # epoch 1: 8 samples committed by 2 ranks, then 4 batches of 4 on each of 3 ranks, none seen twice
    committed = [i for rank in (0, 1) for r in _runs(out, rank)[0]
                 if r["epoch"] == 1 and r["step"] <= LAST_COMMIT for i in r["indices"]]
    resumed = [i for rank in (0, 1, 2) for r in _runs(out, rank)[-1] if r["epoch"] == 1 for i in r["indices"]]
    assert len(set(committed + resumed)) == len(committed) + len(resumed) == 8 + 3 * 16
    redone = [r["step"] for r in _runs(out, 1)[0] if r["step"] > LAST_COMMIT]
    assert redone == list(range(LAST_COMMIT + 1, CRASH_AT + 1))
    assert _commits(tmp_path) == [] and list((tmp_path / "tmp").glob("unidist-elastic-*/*")) == []


EXAMPLE = runnable("elastic")


@pytest.mark.horovod
def test_the_horovod_pages_elastic_example(tmp_path: Path) -> None:
    """docs/coming-from/horovod.md's worked example, each command as written (in order, from the repository's
    root, commits under this test's TMPDIR): horovodrun loses rank 1 when epoch 4 begins and fails, naming the
    last commit; mpiexec on 3 ranks resumes from it, finishes, and leaves nothing behind. What they print (stderr
    and stdout) shows the page's output block, in order."""
    require("horovod", "mpi4py")
    assert len(EXAMPLE) == 1 and EXAMPLE[0].output, [b.where for b in EXAMPLE]
    lines = commands(EXAMPLE[0])
    assert len(lines) == 2 and "horovodrun" in lines[0] and "mpiexec -n 3" in lines[1], lines
    (tmp_path / "tmp").mkdir()
    printed = ""
    for i, line in enumerate(lines):  # through bash, as typed (its variables), both streams in the order printed
        proc = run(["bash", "-c", f"{line} 2>&1"], env={"TMPDIR": str(tmp_path / "tmp")}, cwd=ROOT, timeout=300)
        assert (proc.returncode != 0) == (i == 0), proc.describe()
        printed += proc.stdout
    assert output_matches(EXAMPLE[0].output, printed) is None, (output_matches(EXAMPLE[0].output, printed), printed)
    m = re.search(r"horovod_elastic: size=3 test accuracy ([\d.]+) max parameter difference across ranks (\S+)",
                  printed)
    assert m and float(m.group(1)) >= 0.9 and float(m.group(2)) == 0.0, printed
    assert list((tmp_path / "tmp").glob("unidist-elastic-*/*")) == []
