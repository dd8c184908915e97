"""``with mgr.accumulate(model):`` on every backend and ZeRO stage (tests/workers/accumulate.py), one launch each.

The micro-steps run one rank after another inside the block, so a micro-step that waited on a peer would hang
until the watchdog (``UNIDIST_TIMEOUT=60`` here) ended the job; on unidist's own engines the watched call counter
must not move either. Equal to one process on the whole batch: SGD 1e-5, Adam 1e-4 (float32 rounding; Adam's
division by sqrt(v) amplifies it). Measured at 2 ranks: 7.5e-9 (SGD) and 3.7e-8 (Adam).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, main_launches, require, results, run

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
