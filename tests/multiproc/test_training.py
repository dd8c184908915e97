"""One training loop on every backend: N ranks on B/N rows train exactly like one process on B rows.

tests/workers/equivalence.py trains a small MLP with ``mgr.prepare``/``mgr.backward``/``opt.step`` under
each real launcher and compares with plain single-process torch on the full batch, every rank computing
the reference itself. Parameters must also be identical across ranks after every step.
"""

from __future__ import annotations

import json

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, require, run

TRAINING = [k for k in LAUNCHES if k != "mpiexec-2-checked"]
# float32 end to end agrees to rounding; compressed wires round every gradient once per step
TOLERANCE = {"plain": 1e-5, "k2": 1e-5, "fp16": 1e-3, "bf16": 5e-3}


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in TRAINING])
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Launch, Run, list[dict[str, object]]]:
    launch = LAUNCHES[request.param]
    require(launch.engine)
    out = tmp_path_factory.mktemp(f"eq-{request.param}")
    proc = run(launch.command(str(WORKERS / "equivalence.py"), "--out", str(out)), env=launch.env, timeout=900)
    return launch, proc, [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("variant", list(TOLERANCE))
def test_matches_single_process_training(reports: tuple[Launch, Run, list[dict[str, object]]],
                                         variant: str) -> None:
    launch, proc, res = reports
    assert proc.returncode == 0, proc.describe()
    assert len(res) == launch.size, proc.describe()
    for report in res:
        assert report["backend"] == launch.backend
        r = report[variant]
        assert isinstance(r, dict)
        if variant == "bf16" and launch.backend == "horovod":
            assert "compression='bf16' is unavailable" in str(r.get("refused")), r
            continue
        assert r["max_spread"] == 0.0, r  # every rank holds the same parameters after every step
        assert r["max_diff"] <= TOLERANCE[variant], r


FEATURES = ["mpiexec-2", "mpiexec-3", "torchrun-2"]


@pytest.mark.parametrize("name", [pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in FEATURES])
def test_optimizer_features(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    launch = LAUNCHES[name]
    require(launch.engine)
    out = tmp_path_factory.mktemp(f"features-{name}")
    proc = run(launch.command(str(WORKERS / "optimizer_features.py"), "--out", str(out)), env=launch.env,
               timeout=600)
    assert proc.returncode == 0, proc.describe()
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(launch.size)]
    for r in res:
        # a parameter without gradient on some ranks: no hang, ranks stay identical, several buckets used
        assert r["unused_parameters"]["spread"] == 0.0 and r["unused_parameters"]["buckets"] > 1, r
        # no_sync pass + synced pass == one step on the summed losses
        assert r["no_sync_equals_summed_loss"]["diff"] <= 1e-6, r
        assert r["no_sync_equals_summed_loss"]["spread"] == 0.0
        # Adam state (tensors and step counts) from rank 0 everywhere
        assert r["optimizer_state"]["steps"] == [[2.0, 2.0]] * launch.size
        assert r["optimizer_state"]["exp_avg_spread"] == 0.0
        assert r["sampler"]["mean"] == pytest.approx((launch.size - 1) / 2)
    for epoch in res[0]["sampler"]["epochs"]:
        flat = [i for part in epoch for i in part]
        assert len({len(part) for part in epoch}) == 1  # equal shares
        assert set(flat) == set(range(103))  # everything covered (the tail wraps around)
    first, second = res[0]["sampler"]["epochs"]
    assert first != second  # reshuffled per epoch
