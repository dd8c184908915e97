"""The collective suite, unchanged, under every real launcher; each case is one test per launch.

One launch runs all cases (launches cost seconds); the results are then asserted case by case.
"""

from __future__ import annotations

import json

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, require, results, run
from workers.collectives import plan

CASES = [name for name, _ in plan(2)]
WORKER = str(WORKERS / "collectives.py")


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in LAUNCHES.items()])
def suite(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Launch, Run, dict[int, dict[str, str]]]:
    launch = LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(request.param)
    proc = run(launch.command(WORKER, "--out", str(out)), env=launch.env, timeout=900)
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
