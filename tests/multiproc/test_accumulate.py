"""``with mgr.accumulate(model):`` on every backend and ZeRO stage (tests/workers/accumulate.py), one launch each.

The micro-steps run one rank after another inside the block, so a micro-step that waited on a peer would hang
until the watchdog (``UNIDIST_TIMEOUT=60`` here) ended the job; on unidist's own engines the watched call counter
must not move either. Equal to one process on the whole batch: SGD 1e-5, Adam 1e-4 (float32 rounding; Adam's
division by sqrt(v) amplifies it). Measured at 2 ranks: 7.5e-9 (SGD) and 3.7e-8 (Adam).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest
from helpers import BIN, LAUNCHES, MARKS, WORKERS, Launch, Run, main_launches, require, results, run

TOLERANCE = {"sgd": 1e-5, "adam": 1e-4}
Result = tuple[Launch, Run, dict[int, dict[str, Any]]]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in main_launches(2)])
def accumulated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Result:
    launch = LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(f"accumulate-{request.param}")
    proc = run(launch.command(str(WORKERS / "accumulate.py"), "--out", str(out)),
               env={**launch.env, "UNIDIST_TIMEOUT": "60"}, timeout=600)
    return launch, proc, results(out, launch.size)  # type: ignore[return-value]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", list(TOLERANCE))
def test_accumulate_block(accumulated: Result, optimizer: str, stage: int) -> None:
    launch, proc, res = accumulated
    assert proc.returncode == 0 and sorted(res) == list(range(launch.size)), proc.describe()
    for rank in range(launch.size):
        case = res[rank][f"{optimizer}/stage{stage}"]
        assert "error" not in case, (rank, case)
        assert case["spread"] == 0.0, (rank, case)
        assert case["diff"] <= TOLERANCE[optimizer], (rank, case)
        if launch.own_training:  # (DeepSpeed's and Horovod's backward is a watched region even when it sends nothing)
            assert case["calls_in_micro_steps"] == 0, (rank, case)


@pytest.mark.mpi
def test_bench_accumulate_counts_the_reductions_saved() -> None:
    """`python -m unidist.bench accumulate` (README): tiny sizes, a smoke test of its table, not a timing; the
    per-micro-batch way makes ``--micro`` times the gradient reductions of the accumulate block."""
    require("mpi4py")
    proc = run([str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "unidist.bench", "accumulate", "--width", "64",
                "--layers", "2", "--micro", "3", "--steps", "1", "--rounds", "1"], timeout=300,
               env={"UNIDIST_CHECK_COLLECTIVES": "0"})  # counts the reductions only: no desync check exchanges
    assert proc.returncode == 0, proc.describe()
    rows = re.findall(r"^\| ([02]) \| (accumulate|every micro-batch) \| (\d+) \| ([\d.]+) \|", proc.stdout, re.M)
    assert len(rows) == 4, proc.describe()
    calls = {(stage, way): int(n) for stage, way, n, _ in rows}
    assert calls["0", "every micro-batch"] == 3 * calls["0", "accumulate"]  # one allreduce (launch + wait) each
    assert calls["2", "every micro-batch"] > calls["2", "accumulate"]
