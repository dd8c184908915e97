"""Failing clearly instead of hanging: desync detection, a missing rank, an exception on one rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import LAUNCHES, MARKS, ROOT, WORKERS, main_launches, mpiexec, require, results, run, torchrun

pytestmark = pytest.mark.mpi
WORKER = str(WORKERS / "collectives.py")


def test_desync_is_reported_on_every_rank(tmp_path: Path) -> None:
    proc = run(mpiexec(2, WORKER, "--out", str(tmp_path), "--mode", "desync"),
               env={"UNIDIST_CHECK_COLLECTIVES": "1"}, timeout=120)
    assert proc.returncode == 0, proc.describe()
    res = results(tmp_path, 2)
    assert len(res) == 2, proc.describe()
    for rank, r in res.items():
        assert "rank 0 called allreduce(op=sum" in r["desync"], (rank, r)
        assert "rank 1 called broadcast(root=0" in r["desync"], (rank, r)
        assert "rank 0 called allreduce(op=sum" in r["sum_max"] and "rank 1 called allreduce(op=max" in r["sum_max"]
        assert "dtype=float32" in r["dtype"] and "dtype=float64" in r["dtype"], r
        assert "numel=4" in r["shape"] and "numel=8" in r["shape"], r
        assert "root=0" in r["root"] and "root=1" in r["root"], r
        assert "4 elements of float32" in r["p2p_size"] and "8 elements of float32" in r["p2p_size"], r
        assert "4 elements of float64" in r["p2p_dtype"] and "4 elements of float32" in r["p2p_dtype"], r
        assert ("receiver" if rank == 0 else "sender") in r["p2p_size"], r
        assert r["after"] == "ok"


def test_missing_rank_times_out_instead_of_hanging(tmp_path: Path) -> None:
    """Without the check mode: the watchdog bounds the wait (it used to need UNIDIST_CHECK_COLLECTIVES)."""
    proc = run(mpiexec(2, WORKER, "--out", str(tmp_path), "--mode", "timeout"), env={"UNIDIST_TIMEOUT": "2"},
               timeout=100)
    assert not proc.timed_out, proc.describe()  # rank 1 sleeps 120 s: only the abort ends the job in time
    assert proc.returncode == 124, proc.describe()
    # the call, the worker's own line that made it, and the stall inspector's verdict, looked at before the timeout
    # (or the check before it, which the default one-in-K desync check may make of this call)
    line = next(i for i, text in enumerate(Path(WORKER).read_text().splitlines(), 1) if "rank 1 never joins" in text)
    call = r"(the check that all ranks call )?allreduce\(float32\[4\], (float32\[4\], )?op=sum\)"
    where = re.escape(f"{Path(WORKER).relative_to(ROOT)}:{line}")
    assert re.search(f"unidist: rank 0 of 2: {call} at {where} has waited", proc.stderr), proc.describe()
    assert ("longer than UNIDIST_TIMEOUT=2: a rank this call needs has not arrived: it is still computing (a "
            "straggler)" in proc.stderr), proc.describe()
    assert re.search(r"rank 1 on host \S+ is computing, not yet at collective #\d+ of all ranks", proc.stderr), \
        proc.describe()


def test_exception_on_one_rank_ends_the_job(tmp_path: Path) -> None:
    proc = run(mpiexec(2, WORKER, "--out", str(tmp_path), "--mode", "crash"), timeout=100)
    assert not proc.timed_out, proc.describe()
    assert proc.returncode != 0
    assert "ValueError: deliberate failure on rank 1" in proc.stderr
    assert "rank 1 of 2 failed" in proc.stderr
    assert not (tmp_path / "rank0.json").exists()  # rank 0 never got past its barrier


@pytest.mark.parametrize("name", [pytest.param(k, marks=MARKS[v.backend]) for k, v in main_launches(2).items()
                                  if v.launcher != "mpich"])
def test_exception_on_one_rank_ends_the_job_on_other_launchers(name: str, tmp_path: Path) -> None:
    """torchrun, deepspeed and horovodrun end the job when a worker fails: no hang, non-zero exit."""
    launch = LAUNCHES[name]
    require(*launch.engines)
    proc = run(launch.command(WORKER, "--out", str(tmp_path), "--mode", "crash"), env=launch.env, timeout=200)
    assert not proc.timed_out, proc.describe()
    assert proc.returncode != 0
    assert "deliberate failure on rank 1" in proc.stdout + proc.stderr


@pytest.mark.torch
def test_mpi_backend_under_torchrun_says_what_to_do() -> None:
    """UNIDIST_BACKEND=mpi under torchrun: each process is its own MPI world; the error says so and names the
    fix (it used to blame a different MPI library)."""
    require("mpi4py")
    proc = run(torchrun(2, "examples/hello_collectives.py"), env={"UNIDIST_BACKEND": "mpi"}, timeout=120)
    assert proc.returncode != 0 and not proc.timed_out, proc.describe()
    assert "without an MPI world" in proc.stderr and "Use the torch backend under torchrun" in proc.stderr, \
        proc.describe()


def test_torch_rendezvous_failure_under_mpiexec_ends_the_job() -> None:
    """Rank 0 of a torch-backend job started by mpiexec cannot listen on its rendezvous address: it names the
    address and aborts the MPI job within seconds (the other ranks wait for the address it was to send)."""
    require("mpi4py")
    proc = run(mpiexec(2, str(WORKERS / "store_cannot_listen.py")), env={"UNIDIST_BACKEND": "torch"}, timeout=120)
    assert proc.returncode != 0 and not proc.timed_out, proc.describe()
    assert "rank 0 cannot listen on MASTER_ADDR=192.0.2.77" in proc.stderr, proc.describe()
    assert "started despite" not in proc.stdout, proc.describe()


def test_check_bench_smoke() -> None:
    """`python -m unidist.bench.check` (README) prints one row per size in each table (collectives: off, one in
    K, every call, the ratios and K; point to point: unidist, the engine, the engine with the guard, the ratio);
    not a timing test."""
    require("mpi4py")
    proc = run(mpiexec(2, "-m", "unidist.bench.check", "--rounds", "2", "--sizes", "8", "65536"), timeout=120)
    assert proc.returncode == 0, proc.describe()
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["8", "65536", "8", "65536"], proc.stdout
    assert all(len(r) == 7 and all(float(v) > 0 for v in r[1:]) for r in rows[:2]), proc.stdout
    assert all(len(r) == 5 and all(float(v) > 0 for v in r[1:]) for r in rows[2:]), proc.stdout
