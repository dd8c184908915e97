"""UNIDIST_LOG_LEVEL under mpiexec (issue 40): the variable alone shows unidist's log lines, on stderr, each
with its rank; without it nothing is printed; a script that configured logging keeps its own format, and the
handler is gone after shutdown (tests/workers/log_lines.py)."""

from __future__ import annotations

import re

import pytest
from helpers import WORKERS, mpiexec, require, run

pytestmark = pytest.mark.mpi
WORKER = str(WORKERS / "log_lines.py")


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_the_variable_alone_prints_each_ranks_lines_with_its_rank(level: str) -> None:
    require("mpi4py")
    proc = run(mpiexec(2, WORKER), env={"UNIDIST_LOG_LEVEL": level}, timeout=120)
    assert proc.returncode == 0, proc.describe()
    for r in (0, 1):
        assert re.search(rf"^\[unidist rank {r}/2\] INFO MPIManager started: rank {r} of 2 on \S+$", proc.stderr,
                         re.MULTILINE), proc.describe()
        assert f"[unidist rank {r}/2] INFO rank {r}: after the allreduce\n" in proc.stderr, proc.describe()
        assert f"rank {r}: handlers after shutdown: 0" in proc.stdout, proc.describe()


def test_without_the_variable_nothing_is_printed() -> None:
    require("mpi4py")
    proc = run(mpiexec(2, WORKER), timeout=120)
    assert proc.returncode == 0, proc.describe()
    assert "[unidist rank" not in proc.stderr and "started:" not in proc.stderr, proc.describe()
    assert "after the allreduce" not in proc.stdout + proc.stderr, proc.describe()
    assert all(f"rank {r}: handlers after shutdown: 0" in proc.stdout for r in (0, 1)), proc.describe()


def test_a_script_that_configured_logging_keeps_its_own() -> None:
    require("mpi4py")
    proc = run(mpiexec(2, WORKER, "--configured"), env={"UNIDIST_LOG_LEVEL": "INFO"}, timeout=120)
    assert proc.returncode == 0, proc.describe()
    assert "[unidist rank" not in proc.stderr, proc.describe()
    for r in (0, 1):
        assert f"the script's own: unidist INFO MPIManager started: rank {r} of 2" in proc.stderr, proc.describe()
        assert f"the script's own: unidist INFO rank {r}: after the allreduce" in proc.stderr, proc.describe()
        assert f"rank {r}: handlers after shutdown: 0" in proc.stdout, proc.describe()
