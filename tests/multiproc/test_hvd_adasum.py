"""Adasum (unidist.compat.horovod.adasum) on every launcher: tests/workers/hvd_adasum.py, one launch each.

References, computed by every rank from the seeded inputs of all ranks: Horovod's pairwise formula in the VHDD
tree order in float64 (``err_exact``), and the same tree rounded into the tensor's dtype after every level
(``err_rounded``: what Horovod's kernels store between levels). Errors are relative to the largest |result|.

- against the rounded tree: at most one unit of the dtype's last place (``ULP``); measured 0 (bitwise equal) for
  float16/bfloat16/float32 on 2 and 4 ranks, 1.5e-16 for float64 (the float64 dot products are summed in another
  order than numpy's).
- against the float64 tree: ``8 * u`` (u the dtype's unit roundoff, 2^-24 for float32): at most two levels each
  round the result once (u) and perturb the next level's coefficients through rounded inputs (a few u for the
  well-conditioned vectors here). Measured at 4 ranks: float32 1.1e-7 (1.9u), float16 6.1e-4 (1.2u), bfloat16
  3.1e-3 (0.8u).
- constructed cases are exact: orthogonal -> the sum, identical -> the vector, opposite pairs -> 0, zeros -> 0.
- the Adasum optimizer equals a one-process emulation (each rank's local step from the shared weights on its own
  batch, deltas combined by the tree, added) within 1e-6 (the same float32 operations; measured 0.0), and real
  Horovod's ``DistributedOptimizer(op=Adasum)`` where it runs (MPI: horovod-under-mpiexec), measured 0.0.
- real Horovod's ``allreduce(op=Adasum)`` (MPI only; its gloo controller raises "No Adasum operation enabled"):
  float32 bit for bit, float64 within 1e-15, float16 within one float16 unit (Horovod rounds in float32 FMA).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, require, results, run
from hvd_adasum import CASES, OPT_CASES

ULP = {"f64": 2.0 ** -52, "f32": 2.0 ** -23, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}
EXACT = {k: 8 * v / 2 for k, v in ULP.items()}  # 8 unit roundoffs
ADASUM_LAUNCHES = {
    "mpiexec-2": LAUNCHES["mpiexec-2"],
    "mpiexec-4-checked": LAUNCHES["mpiexec-2-checked"].resized(4),  # 4 ranks, with the desync check
    "mpiexec-3": LAUNCHES["mpiexec-3"],  # the refusal
    "torchrun-2": LAUNCHES["torchrun-2"],
    "deepspeed-2": LAUNCHES["deepspeed-2"],
    "horovodrun-gloo-2": LAUNCHES["horovodrun-gloo-2"],
    "horovod-under-mpiexec-2": LAUNCHES["horovod-under-mpiexec-2"],
}
Result = tuple[Launch, Run, dict[int, dict[str, Any]]]

OPT_KEYS = [f"opt-{kind}-k{k}" for kind, k in OPT_CASES]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in ADASUM_LAUNCHES.items()])
def adasum(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Result:
    launch = ADASUM_LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(f"hvd-adasum-{request.param}")
    proc = run(launch.command(str(WORKERS / "hvd_adasum.py"), "--out", str(out)), env=launch.env, timeout=600)
    got = results(out, launch.size)
    assert proc.returncode == 0 and sorted(got) == list(range(launch.size)), proc.describe()
    assert got[0]["backend"] == launch.backend
    return launch, proc, got  # type: ignore[return-value]


def _powered(res: Result) -> dict[int, dict[str, Any]]:
    launch, _, got = res
    if launch.size & (launch.size - 1):
        pytest.skip("a non-power-of-2 job only refuses")
    return got


def _ok(case: Any, where: Any) -> dict[str, Any]:
    assert isinstance(case, dict) and "error" not in case, (where, case)
    return case


def test_refusals(adasum: Result) -> None:
    launch, _, got = adasum
    for rank, rep in got.items():
        ref = _ok(rep["refusals"], rank)
        assert ref["size3"]["type"] == "AdasumUnsupportedError" and ref["size3"]["not_impl"]
        assert ref["size3"]["msg"].startswith("Running Adasum with non-power of 2 ranks is not supported yet")
        assert ref["nonglobal"]["type"] == "AdasumUnsupportedError" and ref["nonglobal"]["not_impl"]
        assert ref["nonglobal"]["msg"].startswith("Adasum does not support non-global process sets yet")
        assert ref["int"]["type"] == "InvalidArgumentError" and "floating-point" in ref["int"]["msg"]
        if launch.size & (launch.size - 1):  # adasum_ itself refuses at once, on every rank (nothing hangs)
            assert ref["call"]["type"] == "AdasumUnsupportedError", (rank, ref)
            assert f"this job has {launch.size} ranks" in ref["call"]["msg"]
        else:
            assert ref["call"] == "ok", (rank, ref)
        if "UNIDIST_CHECK_COLLECTIVES" in launch.env:  # different shapes on different ranks: every rank names them
            assert ref["mismatch"]["type"] == "CollectiveMismatchError", (rank, ref)
            assert "rank 0: [('torch.float32', (3,))]" in ref["mismatch"]["msg"], (rank, ref)


def test_equals_the_tree_reference(adasum: Result) -> None:
    got = _powered(adasum)
    cases = 0
    for rank, rep in got.items():
        for key, case in rep.items():
            if key.split("-")[-1] not in ULP or key.startswith(("opt-", "real")):
                continue
            case = _ok(case, (rank, key))
            dtype = key.split("-")[-1]
            assert case["spread"] == 0.0, (rank, key, case)  # every rank holds the same result
            assert case["err_rounded"] <= ULP[dtype], (rank, key, case)
            assert case["err_exact"] <= EXACT[dtype], (rank, key, case)
            if "exact_match" in case:
                assert case["exact_match"], (rank, key, case)
            cases += 1
    assert cases == len(CASES) * len(got)


def test_optimizer_equals_the_emulation(adasum: Result) -> None:
    got = _powered(adasum)
    for rank, rep in got.items():
        for key in OPT_KEYS:
            case = _ok(rep[key], (rank, key))
            assert case["moved"] > 0.1 and case["spread"] == 0.0, (rank, key, case)
            assert case["diff"] <= 1e-6, (rank, key, case)
            if "diff_real" in case:
                assert case["diff_real"] <= 1e-6, (rank, key, case)
        assert rep["opt-class"]["is_sgd"] and rep["opt-class"]["name"] == "SGD"


def test_real_horovod(adasum: Result) -> None:
    launch, _, got = adasum
    if launch.backend != "horovod":
        pytest.skip("real Horovod runs under the horovod backend only")
    for rank, rep in got.items():
        real = _ok(rep["real"], rank)
        for case, value in real.items():
            if not isinstance(value, dict):  # mpi_enabled, seconds
                continue
            if not real["mpi_enabled"]:  # Horovod's gloo controller has no Adasum operation
                assert value["error"] == "HorovodInternalError: No Adasum operation enabled", (rank, case, value)
                continue
            assert "error" not in value, (rank, case, value)
            if case.endswith("f32"):
                assert value["bitwise_single"] and value["grouped"] == 0.0, (rank, case, value)
            tol = {"f64": 1e-15, "f16": ULP["f16"]}.get(case.split("-")[-1], 0.0)
            assert value["single"] <= tol and value["grouped"] <= tol, (rank, case, value)
        if real["mpi_enabled"]:
            assert all("diff_real" in rep[k] for k in OPT_KEYS)
