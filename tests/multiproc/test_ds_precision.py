"""prepare(precision=) on DeepSpeed's own engine, ZeRO stages 0-3, against one process with plain torch
(tests/workers/ds_precision.py): one real deepspeed launch with 2 ranks runs every case.

Tolerances, measured (max |w - w_reference| after 10 SGD-momentum steps, lr 1e-3; gradient norms ~18):
- bf16-mixed: 4.2e-5 at every stage. The forward is the same per row, but autocast computes each weight
  gradient as a bfloat16 matmul over the rows a process holds and rounds it to bfloat16 (8 bits): two ranks'
  halves rounded separately and averaged in float32 are not the whole batch rounded once (2^-8 of a gradient
  of ~10, times lr, per step). Bound 1e-4.
- fp16-mixed: 5.2e-6 (float16's 11 bits: 8x finer than bfloat16). Bound 2e-5.
- fp16 clipped (stages 0-3), bf16 clipped with accumulation (stage 3): 1.5e-7 / 1.4e-6 (clipped updates
  are smaller). Bounds 2e-5 / 1e-4 as their precision's. Under ZeRO DeepSpeed unscales and clips in one
  multiplication by 1/(clip*scale), at stage 0 GradScaler unscales and the engine clips after: 7.5e-9 apart.
- bf16-true (stage 0): 4.9e-4, one or two bfloat16 ulps of weights of 0.1-0.25: the model, its gradients
  (reduced in bfloat16, the model's dtype) and the SGD update are bfloat16. Bound 2e-3.
Stages 1-3 equal stage 0 bitwise (but fp16 clipped: 1e-7); ranks agree bitwise; loss-scale sequences and
skipped steps are exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import WORKERS, Run, deepspeed, require, run
from workers.ds_precision import DS_INF_STEPS, INF_STEPS, STEPS, cases

pytestmark = pytest.mark.deepspeed

TOL = {"bf16-mixed": 1e-4, "fp16-mixed": 2e-5, "bf16-true": 2e-3}
CASES = cases()
Reports = tuple[Run, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Reports:
    require("deepspeed")
    out = tmp_path_factory.mktemp("ds_precision")
    proc = run(deepspeed(2, str(WORKERS / "ds_precision.py"), "--out", str(out)), timeout=600)
    return proc, [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def _case(reports: Reports, key: str) -> list[dict[str, Any]]:
    proc, res = reports
    assert proc.returncode == 0 and len(res) == 2, proc.describe()
    got = [r[key] for r in res]
    for rank, g in enumerate(got):
        assert g.get("error") is None, f"rank {rank}: {g.get('error')}"
    return got


@pytest.mark.parametrize("key", list(CASES))
def test_equals_one_process_with_plain_torch(reports: Reports, key: str) -> None:
    c = CASES[key]
    for rank, g in enumerate(_case(reports, key)):
        if c.scaling == {}:
            continue  # GradScaler's defaults overflow in fp16 differently per batch size: see test_scale_backs_off
        assert g["first_norm"] > 5, g  # an engine clipping at 1 would show
        assert g["diff"] <= TOL[c.precision], (rank, key, g["diff"])
        # ZeRO stages 1-3 bitwise equal stage 0 (fp16 clipped: DeepSpeed unscales and clips in one go)
        assert g["vs_stage0"] <= (1e-7 if key.startswith("fp16-clip") else 0.0), (rank, key, g["vs_stage0"])
        assert g["spread"] == 0.0, (rank, key)  # ranks agree bitwise
        assert g["out_dtypes"] == ["torch.float32"], g  # outputs come back as float32
        assert g["k"] == c.k


@pytest.mark.parametrize("key", [k for k, c in CASES.items() if c.precision.endswith("mixed")])
def test_gradients_are_reduced_in_float32(reports: Reports, key: str) -> None:
    for g in _case(reports, key):
        assert g["comm_dtypes"] == ["torch.float32"], g
        assert g["buckets"] in ([], ["torch.float32"]), g  # ZeRO's reduction buckets


@pytest.mark.parametrize("key", [k for k, c in CASES.items() if c.inf_steps])
def test_fp16_skips_the_same_steps_with_the_reference_scale(reports: Reports, key: str) -> None:
    r0, r1 = _case(reports, key)
    for g in (r0, r1):
        assert g["scaler"] == "AgreedGradScaler"
        assert [i for i, s in enumerate(g["skipped"]) if s] == list(INF_STEPS), g  # rank 0 had no inf itself
        assert g["skipped"] == g["ref_skipped"]
        assert g["scales"] == g["ref_scales"], g
        assert g["counts"][-1] == len(INF_STEPS)
    assert len(set(r0["scales"])) > 2  # it grew and backed off


def test_scale_backs_off(reports: Reports) -> None:
    """GradScaler's defaults: the first steps overflow in fp16 (realistic magnitudes) and the scale backs off;
    DeepSpeed alone would skip them without lowering it, forever."""
    r0, r1 = _case(reports, "fp16-defaults/stage2")
    assert r0["scales"] == r1["scales"] and r0["skipped"] == r1["skipped"]
    assert r0["scales"][0] < 2.0**16 and 0 < r0["counts"][-1] < STEPS // 2, r0
    assert r0["spread"] == 0.0


def test_bf16_true_under_zero_is_refused(reports: Reports) -> None:
    _, res = reports
    for r in res:
        err = r["bf16-true/stage2"]["error"]
        assert err is not None and err.startswith("InvalidArgumentError: prepare(precision='bf16-true') is not "
                                                  "available on the deepspeed backend at ZeRO stage 2"), err


def test_the_scale_resumes_from_a_checkpoint(reports: Reports) -> None:
    for g in _case(reports, "fp16-resume/stage2"):
        assert g["loaded"] == g["saved"] and g["saved"][1] == 1, g  # one skipped step, a scale unlike the initial
        assert g["saved"][0] != g["fresh_scale"] and g["weights"] == 0.0, g


@pytest.mark.parametrize("stage", [0, 2])
def test_a_deepspeed_fp16_section_follows_deepspeeds_scaler(reports: Reports, stage: int) -> None:
    """compat.deepspeed's loss_scaling on DeepSpeed's engine: DeepSpeed's own scaler's sequence (hysteresis at
    ZeRO, none at stage 0), the same on both ranks, overflow steps skipped."""
    r0, r1 = _case(reports, f"fp16-ds-section/stage{stage}")
    for g in (r0, r1):
        assert g["scales"] == g["ref_scales"], g
        assert [i for i, s in enumerate(g["skipped"]) if s] == list(DS_INF_STEPS), g
        assert g["spread"] == 0.0
    assert r0["scales"] == r1["scales"]
    assert (r0["scales"][1] == r0["scales"][0]) == (stage > 0)  # the first overflow absorbed by hysteresis
