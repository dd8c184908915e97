"""The collective suite on groups under the real launchers at 3 and 4 ranks (tests/workers/group_suite.py).

One launch per launcher runs every pass: ``split(rank % 2)`` groups, a ``new_group([0, n-1])`` subset and
``split(rank % 2, key=-rank)`` groups ordered backwards, each with a world allreduce after every case; a
backwards world, one-rank groups, error cases, and data parallel within two groups at once. Results are
asserted per pass and case family, naming each failing case and rank.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, main_launches, require, results, run
from workers.collectives import plan
from workers.group_suite import SKIP, sample

WORKER = str(WORKERS / "group_suite.py")
# Every case at 3 ranks (mpi and torch); at 4 ranks, where 4 processes share 2 cores, a sample of each family
# (cases per family): Horovod ~15 ms a call (all 3 suites: 8.5 min; 12 a family: 184 s in CI, 4: 104 s), DeepSpeed's
# gloo ~1 ms, mpi and torch 35-60 s for every case. The groups' logic is unidist's, the same on every engine.
GROUP_LAUNCHES = {**{k: v for k, v in LAUNCHES.items() if v.size == 3}, **main_launches(4)}
SAMPLED = {k: 2 if v.backend == "horovod" else 6 for k, v in GROUP_LAUNCHES.items() if v.size == 4}
PASSES = ("split/", "subset/", "reversed/")
Suite = tuple[str, Launch, Run, dict[int, dict[str, str]]]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in GROUP_LAUNCHES.items()])
def suite(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Suite:
    launch = GROUP_LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(request.param)
    args = ["--sample", str(SAMPLED[request.param])] if request.param in SAMPLED else []
    proc = run(launch.command(WORKER, "--out", str(out), *args), env=launch.env, timeout=900)
    return request.param, launch, proc, results(out, launch.size)


def _expected(name: str, size: int) -> list[str]:
    cases = [c for c in plan(size) if c[0] not in SKIP]
    return [n for n, _ in (sample(cases, SAMPLED[name]) if name in SAMPLED else cases)]


def test_launch(suite: Suite) -> None:
    _, launch, proc, res = suite
    assert proc.returncode == 0, proc.describe()
    assert sorted(res) == list(range(launch.size)), proc.describe()
    for rank in res:
        meta = json.loads(res[rank]["_meta"])
        assert (meta["backend"], meta["size"]) == (launch.backend, launch.size)


@pytest.mark.parametrize("prefix", PASSES)
def test_pass(suite: Suite, prefix: str) -> None:
    """Every case of the pass ran on every member and matched numpy; non-members of the subset ran none."""
    name, launch, proc, res = suite
    assert sorted(res) == list(range(launch.size)), f"not every rank reported\n{proc.describe()}"
    n = launch.size
    for rank in range(n):
        member = prefix != "subset/" or rank in (0, n - 1)
        got = {k[len(prefix):]: v for k, v in res[rank].items() if k.startswith(prefix)}
        if not member:
            assert not got, f"rank {rank} is outside new_group([0, {n - 1}]) but ran {sorted(got)[:3]}"
            continue
        size = 2 if prefix == "subset/" or rank % 2 == 0 or n == 4 else 1
        assert sorted(got) == sorted(_expected(name, size)), f"rank {rank}: cases run differ from the plan"
        failed = {k: v for k, v in got.items() if v != "ok"}
        by_family = Counter(k.split("[")[0] for k in failed)
        assert not failed, (f"rank {rank}: {len(failed)} of {len(got)} {prefix} cases failed {dict(by_family)}; "
                            f"first: {next(iter(failed.items()))}")


@pytest.mark.parametrize("case", ["world-interleaved", "subset-membership", "reversed", "solo", "errors", "dp"])
def test_case(suite: Suite, case: str) -> None:
    _, launch, proc, res = suite
    assert sorted(res) == list(range(launch.size)), f"not every rank reported\n{proc.describe()}"
    for rank in range(launch.size):
        assert res[rank].get(case) == "ok", f"rank {rank}: {res[rank].get(case, 'not run')}"


def test_data_parallel_per_group(suite: Suite) -> None:
    """prepare(group=g) in both split(rank % 2) groups at once: each group equals one process trained on its
    own batches, members agree bitwise, and the two groups end with different models."""
    _, launch, _, res = suite
    for rank in range(launch.size):
        meta = json.loads(res[rank]["_meta"])
        assert meta["dp_max_diff"] <= 1e-5, (rank, meta)
        assert meta["dp_group_spread"] == 0.0, (rank, meta)
        assert meta["dp_groups_differ"] is True, (rank, meta)
