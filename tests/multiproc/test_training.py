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
