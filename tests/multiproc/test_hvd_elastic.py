"""hvd.elastic under real launchers: a rank dies mid-epoch and the job resumes from its last commit.

tests/workers/hvd_elastic.py trains an SGD-momentum and an Adam model in one TorchState on 2 ranks (3 epochs
of 8 steps, an ElasticSampler, a commit every 3 steps written to disk: UNIDIST_ELASTIC_COMMIT_SECONDS=0);
rank 1 calls os._exit(1) after step 11 on the first attempt only. Under ``torchrun --max-restarts 1`` the
job restarts itself; under mpiexec the first launch fails and the same command run again resumes (and a copy
of the commit resumes on 3 ranks). Both end with the weights of the uninterrupted run (simulated in this
process with plain torch: 0.0 here, 1e-6 allowed), redo exactly the 2 steps since the last commit (step 9),
process every sample of every epoch once, and leave no commit behind (the default commit directory, under
TMPDIR).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import LAUNCHES, MARKS, WORKERS, Launch, require, results, run
from hvd_elastic import BATCH, EPOCHS, N, simulate

WORKER = str(WORKERS / "hvd_elastic.py")
CRASH_AT, EVERY = 11, 3
LAST_COMMIT = CRASH_AT - CRASH_AT % EVERY  # 9


def _env(tmp_path: Path, launch: Launch) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)  # the default commit directory goes under it
    return {**launch.env, "TMPDIR": str(tmp_path / "tmp"), "UNIDIST_ELASTIC_COMMIT_SECONDS": "0"}


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
    assert "attempt 1: resuming from" in proc.stderr and f"'step': {LAST_COMMIT}" in proc.stderr, proc.describe()
    assert all(r["attempt"] == 1 for r in results(out, 2).values())
    _check(out)
    assert _commits(tmp_path) == []


@pytest.mark.parametrize(("launch", "bigger"), [pytest.param("mpiexec-2", "mpiexec-3", marks=MARKS["mpi"])])
def test_mpiexec_fails_then_resumes(tmp_path: Path, launch: str, bigger: str) -> None:
    """The first launch fails; the same command again resumes from the default commit directory. And, from a
    copy of that commit (UNIDIST_ELASTIC_DIR), the job resumes on 3 ranks: the sampler re-deals the rest of the
    epoch over 3, the reset callbacks see size 3, and the weights equal the simulated 2-then-3-rank run."""
    lch, large = LAUNCHES[launch], LAUNCHES[bigger]
    require(*lch.engines, *large.engines)
    out = tmp_path / "out"
    out.mkdir()
    argv = lch.command(WORKER, "--out", str(out), "--crash-at", str(CRASH_AT), "--crash-marker",
                       str(tmp_path / "crashed"))
    first = run(argv, env=_env(tmp_path, lch), timeout=300)
    assert first.returncode != 0, first.describe()
    assert f"crashes after step {CRASH_AT}" in first.stdout, first.describe()
    commits = _commits(tmp_path)
    assert [p.name for p in commits] == ["commit-000000002", "commit-000000003"]
    shutil.copytree(commits[0].parent, tmp_path / "copy")
    shutil.copytree(out, tmp_path / "out3")

    second = run(argv, env=_env(tmp_path, lch), timeout=300)
    assert second.returncode == 0, second.describe()
    assert "attempt 0: resuming from" in second.stderr and "commit-000000003" in second.stderr, second.describe()
    _check(out)
    assert _commits(tmp_path) == []

    out3 = tmp_path / "out3"
    third = run(large.command(WORKER, "--out", str(out3), "--crash-at", str(CRASH_AT), "--crash-marker",
                              str(tmp_path / "crashed")),
                env={**_env(tmp_path, large), "UNIDIST_ELASTIC_DIR": str(tmp_path / "copy")}, timeout=300)
    assert third.returncode == 0, third.describe()
    assert f"'step': {LAST_COMMIT}" in third.stderr, third.describe()
    ref = simulate(2, LAST_COMMIT, 3)
    res = results(out3, 3)
    assert sorted(res) == [0, 1, 2]
    for rank, rep in res.items():
        worst = max(float((torch.tensor(rep["weights"][m][k]) - torch.tensor(w)).abs().max())  # type: ignore[index]
                    for m, weights in ref.items() for k, w in weights.items())
        assert worst <= 1e-6, (rank, worst)
        assert rep["resets"] == [3], rep["resets"]
    # epoch 1: 8 samples committed by 2 ranks, then 4 batches of 4 on each of 3 ranks, none seen twice
    committed = [i for rank in (0, 1) for r in _runs(out3, rank)[0]
                 if r["epoch"] == 1 and r["step"] <= LAST_COMMIT for i in r["indices"]]
    resumed = [i for rank in (0, 1, 2) for r in _runs(out3, rank)[-1] if r["epoch"] == 1 for i in r["indices"]]
    assert len(set(committed + resumed)) == len(committed) + len(resumed) == 8 + 3 * 16
    assert list((tmp_path / "copy").iterdir()) == []
