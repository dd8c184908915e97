"""DeepSpeed prepare/backward: ZeRO stages 0-3 in one real deepspeed launch (launches cost seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import WORKERS, Run, deepspeed, require, run

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, list[dict[str, object]]]:
    require("deepspeed")
    out = tmp_path_factory.mktemp("ds_prepare")
    proc = run(deepspeed(2, str(WORKERS / "deepspeed_prepare.py"), "--out", str(out)), timeout=900)
    return proc, [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_trains_and_ranks_agree(reports: tuple[Run, list[dict[str, object]]], stage: int) -> None:
    proc, res = reports
    assert proc.returncode == 0, proc.describe()
    assert len(res) == 2, proc.describe()
    for report in res:
        assert report["backend"] == "deepspeed"
        r = report[f"stage{stage}"]
        assert isinstance(r, dict)
        assert r["last"] < 0.7 * r["first"], r  # loss went down
        assert r["param_spread"] == 0.0, r  # every parameter identical on both ranks
        assert r["numel"] == 161
        if stage:
            assert "ZeroOptimizer" in str(r["optimizer"]), r
