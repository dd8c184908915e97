"""unidist.compat.horovod against numpy and against real Horovod, every API function, one launch per launcher.

tests/workers/hvd_api.py runs the case table of tests/workers/hvd_cases*.py (every horovod.torch function:
values, dtypes, shapes, in-place identity, handles, process sets, errors, backward passes) and writes each
rank's results. Here every case is compared with numpy's result from the same per-rank inputs (hvd_cases'
``want``), and, in the horovod env, real Horovod's results under ``horovodrun --gloo -np 2`` are compared with
numpy's and with compat's, case by case (an error's class must be the builtin Horovod raises, or a subclass).
"""

from __future__ import annotations

import time
from typing import Any

import hvd_cases_more  # noqa: F401  (extends CASES)
import numpy as np
import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, require, results, run
from hvd_api import encode
from hvd_cases import CASES, Err

# mpiexec-2 in check mode: the same math, plus the name-mismatch case
HVD_LAUNCHES = {k: LAUNCHES[k] for k in ("local-1", "mpiexec-2-checked", "mpiexec-3", "torchrun-2",
                                         "deepspeed-2", "horovodrun-gloo-2", "horovod-under-mpiexec-2")}
RTOL = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}
Outcome = tuple[Launch, Any, dict[int, dict[str, Any]], float]
_runs: dict[str, Outcome] = {}


def _launch(key: str, launch: Launch, impl: str, tmp: Any) -> Outcome:
    if (key, impl) not in _runs:
        require(*launch.engines)
        out = tmp.mktemp(f"hvd-{impl}-{key}")
        start = time.perf_counter()
        proc = run(launch.command(str(WORKERS / "hvd_api.py"), "--impl", impl, "--out", str(out)), env=launch.env,
                   timeout=300)
        wall = time.perf_counter() - start
        print(f"hvd_api {impl} {key}: {wall:.1f} s")  # the launch's wall time (pytest -s shows it)
        _runs[(key, impl)] = (launch, proc, results(out, launch.size), wall)  # type: ignore[index]
    return _runs[(key, impl)]  # type: ignore[index]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in HVD_LAUNCHES.items()])
def compat(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    return _launch(request.param, HVD_LAUNCHES[request.param], "compat", tmp_path_factory)


def same(want: Any, got: Any, where: str) -> None:
    """Encoded items equal: dtype, shape and values (floats to their dtype's rounding); errors by builtin."""
    if isinstance(want, dict) and "error" in want:
        assert isinstance(got, dict) and "error" in got, (where, want, got)
        assert want["bases"][0] in got["bases"], (where, want, got)
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and "values" in got, (where, want, got)
        assert (got["dtype"], got["shape"]) == (want["dtype"], want["shape"]), (where, want, got)
        a, b = np.array(got["values"], dtype=np.float64), np.array(want["values"], dtype=np.float64)
        rtol = RTOL.get(want["dtype"], 0.0)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        assert np.allclose(a, b, rtol=rtol, atol=rtol * scale, equal_nan=True), (where, want, got)
        return
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, want, got)
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            same(w, g, f"{where}[{i}]")
        return
    assert type(got) is type(want) and got == want, (where, want, got)


def check_against_numpy(outcome: Outcome, impl: str, checked: bool) -> int:
    launch, proc, got, _ = outcome
    assert proc.returncode == 0 and sorted(got) == list(range(launch.size)), proc.describe()
    compared = 0
    for rank, cases in got.items():
        for case in CASES:
            skipped = launch.size < case.min_size or (impl == "horovod" and not case.horovod) or \
                (case.checked and not checked)
            if skipped:
                assert case.name not in cases, (rank, case.name)
                continue
            result, want = cases[case.name], case.want(rank, launch.size)
            where = f"{impl} rank {rank} {case.name}"
            if isinstance(want, Err):
                same(encode(want), result.get("uncaught"), where)
            else:
                assert "uncaught" not in result, (where, result)
                same(encode(want), result["items"], where)
            compared += 1
    return compared


def test_every_case_matches_numpy(compat: Outcome) -> None:
    launch = compat[0]
    checked = launch.env.get("UNIDIST_CHECK_COLLECTIVES") == "1"
    assert check_against_numpy(compat, "compat", checked) >= launch.size * 40
    assert compat[2][0]["_meta"]["backend"] == launch.backend


@pytest.mark.horovod
def test_real_horovod_matches_numpy_and_compat(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The numpy model of Horovod's math is real Horovod's; compat gives the same items, case by case."""
    launch = HVD_LAUNCHES["horovodrun-gloo-2"]
    real = _launch("horovodrun-gloo-2", launch, "horovod", tmp_path_factory)
    assert check_against_numpy(real, "horovod", False) >= 2 * 40
    ours = _launch("horovodrun-gloo-2", launch, "compat", tmp_path_factory)
    assert ours[1].returncode == 0, ours[1].describe()
    for rank in range(launch.size):
        for name, theirs in real[2][rank].items():
            if name == "_meta":
                continue
            mine = ours[2][rank][name]
            if "uncaught" in theirs:
                same(theirs["uncaught"], mine.get("uncaught"), f"rank {rank} {name}")
            else:
                same(theirs["items"], mine["items"], f"rank {rank} {name}")
