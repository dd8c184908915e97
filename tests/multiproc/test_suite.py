"""The collective suite, unchanged, under every real launcher; each case is one test per launch.

One launch runs all cases (launches cost seconds); the results are then asserted case by case.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from helpers import WORKERS, Run, deepspeed, horovodrun, mpiexec, require, results, run, torchrun
from workers.collectives import plan

CASES = [name for name, _ in plan(2)]
WORKER = str(WORKERS / "collectives.py")


@dataclass(frozen=True)
class Launch:
    size: int
    argv: Callable[[int, str], list[str]]
    backend: str
    engine: str = "torch"
    env: dict[str, str] = field(default_factory=dict)


LAUNCHES = {
    "mpiexec-2": Launch(2, mpiexec, "mpi", "mpi4py"),
    "mpiexec-3": Launch(3, mpiexec, "mpi", "mpi4py"),
    "mpiexec-2-checked": Launch(2, mpiexec, "mpi", "mpi4py", {"UNIDIST_CHECK_COLLECTIVES": "1"}),
    "torchrun-2": Launch(2, torchrun, "torch"),
    "torch-under-mpiexec-3": Launch(3, mpiexec, "torch", "mpi4py", {"UNIDIST_BACKEND": "torch"}),
    "deepspeed-2": Launch(2, deepspeed, "deepspeed", "deepspeed"),
    "horovodrun-gloo-2": Launch(2, horovodrun, "horovod", "horovod"),
    "horovod-under-mpiexec-2": Launch(2, mpiexec, "horovod", "horovod", {"UNIDIST_BACKEND": "horovod"}),
}
MARKS = {"mpi": pytest.mark.mpi, "torch": pytest.mark.torch, "deepspeed": pytest.mark.deepspeed,
         "horovod": pytest.mark.horovod}


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in LAUNCHES.items()])
def suite(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Launch, Run, dict[int, dict[str, str]]]:
    launch = LAUNCHES[request.param]
    require(launch.engine)
    out = tmp_path_factory.mktemp(request.param)
    proc = run(launch.argv(launch.size, WORKER, "--out", str(out)), env=launch.env, timeout=900)
    return launch, proc, results(out, launch.size)


def test_launch(suite: tuple[Launch, Run, dict[int, dict[str, str]]]) -> None:
    launch, proc, res = suite
    assert proc.returncode == 0, proc.describe()
    assert sorted(res) == list(range(launch.size)), proc.describe()
    for rank in res:
        meta = json.loads(res[rank]["_meta"])
        assert (meta["backend"], meta["size"]) == (launch.backend, launch.size)


@pytest.mark.parametrize("case", CASES)
def test_case(suite: tuple[Launch, Run, dict[int, dict[str, str]]], case: str) -> None:
    launch, proc, res = suite
    assert sorted(res) == list(range(launch.size)), f"not every rank reported\n{proc.describe()}"
    for rank in range(launch.size):
        assert res[rank].get(case) == "ok", f"rank {rank}: {res[rank].get(case, 'not run')}"
