"""deepspeed.init_distributed and deepspeed.comm (unidist.compat.deepspeed) under every launcher, one launch each.

tests/workers/ds_compat_dist.py calls ``init_distributed`` as a DeepSpeed script does and nothing of unidist's,
so the Manager starts inside it and the gloo world and the Manager end at exit (atexit, the world first): the
exit code checks that order. Checked here, per rank: DeepSpeed's five variables exist and match the launcher's
ranks (and the launcher's own values are kept where it set all five), every rank agrees on MASTER_ADDR and
MASTER_PORT, torch.distributed's rank/world/all_reduce agree with unidist's Manager, and each comm case (every
ReduceOp, async, reduce, all_gather(_into_tensor), reduce_scatter(_tensor), all_to_all(_single), gather,
scatter, broadcast, a subgroup) equals numpy on the same per-rank inputs. In the deepspeed env, real
``deepspeed.init_distributed`` runs once under mpiexec and its variables are compared with compat's
(MASTER_ADDR differs on purpose: see dist.py).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, free_port, require, results, run

DIST_LAUNCHES = {k: LAUNCHES[k] for k in ("local-1", "mpiexec-2", "torchrun-2", "horovodrun-gloo-2", "deepspeed-2")}
RTOL = 1e-6  # float32 rounding of sums over 2 ranks at the inputs' scale (measured 0 to 2.4e-7 relative ~2e-8)
Outcome = tuple[Launch, Any, dict[int, dict[str, Any]], int]
_runs: dict[tuple[str, str], Outcome] = {}  # one launch per (launcher, impl) for the whole module


def _launch(launch: Launch, impl: str, tmp: Any, label: str) -> Outcome:
    if (label, impl) in _runs:
        return _runs[(label, impl)]
    require(*launch.engines)
    out = tmp.mktemp(f"ds-dist-{impl}-{label}")
    port = free_port()
    start = time.perf_counter()
    proc = run(launch.command(str(WORKERS / "ds_compat_dist.py"), "--out", str(out), "--impl", impl, "--port",
                              str(port)), env=launch.env, timeout=240)
    print(f"ds_compat_dist {impl} {label}: {time.perf_counter() - start:.1f} s")  # pytest -s shows it
    _runs[(label, impl)] = (launch, proc, results(out, launch.size), port)
    return _runs[(label, impl)]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in DIST_LAUNCHES.items()])
def compat(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return _launch(DIST_LAUNCHES[request.param], "compat", tmp_path_factory, request.param)


def _ranks(res: Outcome) -> dict[int, dict[str, Any]]:
    launch, proc, got, _ = res
    assert proc.returncode == 0 and sorted(got) == list(range(launch.size)), proc.describe()
    assert "terminate called" not in proc.stderr, proc.describe()  # the world ended before the Manager, in order
    return got


def test_variables_match_the_launchers_ranks(compat: Outcome) -> None:
    launch, _, _, port = compat
    got = _ranks(compat)
    for rank, rep in got.items():
        assert rep["backend"] == launch.backend
        env, before = rep["env"], rep["env_before"]
        mgr_rank, size, local_rank = rep["mgr"]
        assert (mgr_rank, size) == (rank, launch.size)
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == str(launch.size)
        assert env["LOCAL_RANK"] == str(local_rank) == str(rank)  # one node: local ranks are the ranks
        assert rep["every_env"] == [got[r]["env"] for r in range(launch.size)]
        if all(v is not None for v in before.values()):  # the launcher set all five: kept as they are
            assert env == before, rep
        else:  # DeepSpeed's discovery case: MASTER_PORT is distributed_port (free: the test picked it)
            assert env["MASTER_PORT"] == str(port) and not rep["warnings"], rep
            assert env["MASTER_ADDR"] == "127.0.0.1"
        assert len({(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in got.values()}) == 1


def test_torch_distributed_agrees_with_the_manager(compat: Outcome) -> None:
    launch, *_ = compat
    n = launch.size
    for rank, rep in _ranks(compat).items():
        assert rep["torch"] == [rank, n, [n * (n + 1) / 2] * 3]
        assert rep["comm"] == [rank, n, rep["mgr"][2], 0]


def test_comm_functions_equal_numpy(compat: Outcome) -> None:
    for rank, rep in _ranks(compat).items():
        assert len(rep["cases"]) == 21
        for name, case in rep["cases"].items():
            assert "error" not in case, (rank, name, case.get("error"))
            assert case["shape"] == case["want_shape"], (rank, name, case)
            if name != "new_group":  # (its even ranks report the group's ranks beside the values, in float64)
                bitwise = name.split("/")[-1] in ("BAND", "BOR", "BXOR")
                assert case["dtype"] == ("int64" if bitwise else "float32"), (rank, name, case)
            assert case["diff"] <= RTOL * case["scale"], (rank, name, case)


@pytest.mark.deepspeed
def test_variables_equal_real_deepspeeds_under_mpiexec(tmp_path_factory: pytest.TempPathFactory) -> None:
    launch = LAUNCHES["mpiexec-2"]
    require("deepspeed", *launch.engines)
    real = _launch(launch, "deepspeed", tmp_path_factory, "mpiexec-2")
    ours = _launch(launch, "compat", tmp_path_factory, "mpiexec-2")  # the compat fixture's launch when it ran
    got_real, got_ours = _ranks(real), _ranks(ours)
    for rank in range(launch.size):
        want, env = got_real[rank]["env"], got_ours[rank]["env"]
        assert want["MASTER_PORT"] == str(real[3]) and env["MASTER_PORT"] == str(ours[3])  # distributed_port
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            assert env[name] == want[name], (rank, name, want, env)
        assert got_real[rank]["torch"] == [rank, launch.size]
        # DeepSpeed: the first address of `hostname -I`; compat: loopback, as every rank is on this node
        assert want["MASTER_ADDR"] and env["MASTER_ADDR"] == "127.0.0.1"
