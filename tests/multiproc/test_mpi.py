"""The collective suite under real ``mpiexec`` (MPICH's hydra from the mpich wheel), 2 and 3 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import WORKERS, Run, mpiexec, results, run
from workers.collectives import plan

pytestmark = pytest.mark.mpi
CASES = [name for name, _ in plan(2)]
WORKER = str(WORKERS / "collectives.py")


def _suite(tmp_path_factory: pytest.TempPathFactory, n: int, **env: str) -> tuple[Run, dict[int, dict[str, str]]]:
    out = tmp_path_factory.mktemp(f"mpi{n}")
    proc = run(mpiexec(n, WORKER, "--out", str(out)), env=env, timeout=600)
    return proc, results(out, n)


@pytest.fixture(scope="module")
def mpi2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[int, dict[str, str]]]:
    return _suite(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def mpi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[int, dict[str, str]]]:
    return _suite(tmp_path_factory, 3)


def _check(suite: tuple[Run, dict[int, dict[str, str]]], n: int, case: str) -> None:
    proc, res = suite
    assert sorted(res) == list(range(n)), f"not every rank reported\n{proc.describe()}"
    for rank in range(n):
        assert res[rank].get(case) == "ok", f"rank {rank}: {res[rank].get(case, 'not run')}"


def test_mpi2_run(mpi2: tuple[Run, dict[int, dict[str, str]]]) -> None:
    proc, res = mpi2
    assert proc.returncode == 0, proc.describe()
    meta = json.loads(res[0]["_meta"])
    assert meta["backend"] == "mpi"
    assert meta["size"] == 2


@pytest.mark.parametrize("case", CASES)
def test_mpi2(mpi2: tuple[Run, dict[int, dict[str, str]]], case: str) -> None:
    _check(mpi2, 2, case)


def test_mpi3_run(mpi3: tuple[Run, dict[int, dict[str, str]]]) -> None:
    proc, res = mpi3
    assert proc.returncode == 0, proc.describe()
    assert json.loads(res[0]["_meta"])["size"] == 3


@pytest.mark.parametrize("case", CASES)
def test_mpi3(mpi3: tuple[Run, dict[int, dict[str, str]]], case: str) -> None:
    _check(mpi3, 3, case)


def test_suite_with_collective_checks_on(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Desync detection must not flag a correct program."""
    proc, res = _suite(tmp_path_factory, 2, UNIDIST_CHECK_COLLECTIVES="1")
    assert proc.returncode == 0, proc.describe()
    failed = {k: v for r in res.values() for k, v in r.items() if v.startswith("FAIL")}
    assert len(res) == 2, proc.describe()
    assert not failed, failed


def test_desync_is_reported_on_every_rank(tmp_path: Path) -> None:
    proc = run(mpiexec(2, WORKER, "--out", str(tmp_path), "--mode", "desync"),
               env={"UNIDIST_CHECK_COLLECTIVES": "1"}, timeout=120)
    assert proc.returncode == 0, proc.describe()
    for rank, res in results(tmp_path, 2).items():
        assert "rank 0 called allreduce(op=sum" in res["desync"], (rank, res)
        assert "rank 1 called broadcast(root=0" in res["desync"], (rank, res)
        assert res["after"] == "ok"


def test_missing_rank_times_out_instead_of_hanging(tmp_path: Path) -> None:
    proc = run(mpiexec(2, WORKER, "--out", str(tmp_path), "--mode", "timeout"),
               env={"UNIDIST_CHECK_COLLECTIVES": "1", "UNIDIST_TIMEOUT": "2"}, timeout=100)
    assert not proc.timed_out, proc.describe()  # rank 1 sleeps 120 s: only the abort ends the job in time
    assert proc.returncode != 0
    assert "CollectiveTimeoutError: rank 0 waited 2 s in allreduce" in proc.stderr, proc.describe()


def test_exception_on_one_rank_ends_the_job(tmp_path: Path) -> None:
    proc = run(mpiexec(2, WORKER, "--out", str(tmp_path), "--mode", "crash"), timeout=100)
    assert not proc.timed_out, proc.describe()
    assert proc.returncode != 0
    assert "ValueError: deliberate failure on rank 1" in proc.stderr
    assert "rank 1 of 2 failed" in proc.stderr
    assert not (tmp_path / "rank0.json").exists()  # rank 0 never got past its barrier
