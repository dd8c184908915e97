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


def test_unidist_reducer_replaces_the_engines_at_stage_0(reports: tuple[Run, list[dict[str, object]]]) -> None:
    """prepare(reducer='auto') at stage 0: the engine's own allreduce is off and unidist's buckets average the
    gradients to the same weights as DeepSpeed's allreduce (gradient norms far above 1: no clip, no rescale)."""
    proc, res = reports
    assert proc.returncode == 0, proc.describe()
    for report in res:
        r = report["reducers"]
        assert isinstance(r, dict)
        assert r["auto_engine_allreduce_on"] is False and r["engine_allreduce_on"] is True, r
        assert r["first_grad_norm"] > 5.0, r
        assert r["max_diff"] <= 1e-5 and r["spread"] == 0.0, r
        assert "prepare(reducer='fastest'); use one of auto, engine, unidist" in str(r["bad"]), r
        assert "DeepSpeed's ZeRO reduces its own partitions" in str(r["zero1"]), r
