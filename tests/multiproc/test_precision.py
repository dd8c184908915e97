"""prepare(precision=) on every backend and ZeRO stage (tests/workers/precision.py), one launch per backend: its
main launcher (a second launcher of an engine, torch or Horovod under mpiexec, runs the same math; CI time).

N ranks against one process of plain torch with the same precision (autocast, a bfloat16 model, GradScaler).
Tolerances, measured at 2 ranks and why they are what they are:

- ``32``: 1e-5, float32 rounding (measured 7e-9).
- ``bf16-mixed``: 1e-4. The forward's matmuls round to bfloat16 (8 significant bits); a rank's gradient over its
  B/N rows is rounded before the ranks' sum, the whole batch's once, so gradients differ by ~2^-8 relative and
  SGD carries that into the weights (measured 3.0e-5).
- ``fp16-mixed``: 2e-5, the same with float16's 11 bits (measured 3.6e-6; with clipping and accumulation 3.7e-8).
- ``bf16-true``: 1e-3, two bfloat16 steps at the weights' magnitude (|w| < 0.125: one step is 2^-11 = 4.9e-4):
  the update is rounded into bfloat16 weights, so a differently rounded gradient can move a weight by one step
  (measured 4.9e-4).
- ``bf16-master``: 1e-3, the same bfloat16 weights, written from float32 master copies: one process equals the
  reference exactly; at 2 ranks a differently rounded gradient moves a weight by one step (measured 4.9e-4). A run
  resumed from a checkpoint equals the uninterrupted one exactly, which it does only if the checkpoint kept the
  float32 copies (the rounded weights alone: 9.8e-4 off, measured by dropping them).

For fp16 an inf is injected into the last rank's loss at steps 2 and 4: every rank skips exactly those steps and
the loss-scale sequence is GradScaler's (so it is the same on every backend).
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import MARKS, WORKERS, Launch, Run, main_launches, require, results, run, solo_launches

TOLERANCE = {"32": 1e-5, "bf16-mixed": 1e-4, "fp16-mixed": 2e-5, "bf16-true": 1e-3, "bf16-master": 1e-3}
PRECISION_LAUNCHES = {**solo_launches(), **main_launches(2)}
Result = tuple[Launch, Run, dict[int, dict[str, Any]]]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in PRECISION_LAUNCHES.items()])
def precision(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Result:
    launch = PRECISION_LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(f"precision-{request.param}")
    proc = run(launch.command(str(WORKERS / "precision.py"), "--out", str(out)), env=launch.env, timeout=600)
    return launch, proc, results(out, launch.size)  # type: ignore[return-value]


def _cases(res: Result) -> list[tuple[int, str, dict[str, Any]]]:
    launch, proc, got = res
    assert proc.returncode == 0 and sorted(got) == list(range(launch.size)), proc.describe()
    assert got[0]["_meta"]["backend"] == launch.backend
    return [(rank, key, case) for rank in got for key, case in got[rank].items() if not key.startswith("_")]


@pytest.mark.parametrize("mode", list(TOLERANCE))
def test_equals_one_process_with_the_same_precision(precision: Result, mode: str) -> None:
    cases = [c for c in _cases(precision) if c[1].split("/")[0].split("+")[0] == mode]
    assert cases
    for rank, key, case in cases:
        if precision[0].backend == "deepspeed" and mode == "bf16-true" and not key.endswith("stage0"):
            # DeepSpeed's ZeRO always keeps float32 master partitions: a typed refusal, not another meaning
            assert "InvalidArgumentError: prepare(precision='bf16-true') is not available on the deepspeed " \
                   "backend at ZeRO stage" in case.get("error", ""), (rank, key, case)
            continue
        assert "error" not in case, (rank, key, case)
        assert case["spread"] == 0.0, (rank, key, case)  # every rank holds the same weights
        assert case["diff"] <= TOLERANCE[mode], (rank, key, case)


def test_fp16_skips_the_same_steps_everywhere(precision: Result) -> None:
    seen = set()
    for rank, key, case in _cases(precision):
        if not key.startswith("fp16-mixed"):
            continue
        assert "error" not in case, (rank, key, case)
        skipped = [i for i, (_, skip) in enumerate(case["seq"]) if skip]
        assert skipped == [2, 4], (rank, key, case["seq"])  # the inf was injected on the last rank only
        assert case["seq"] == case["want_seq"], (rank, key)  # GradScaler's scale sequence, step by step
        seen.add(key)
    assert {"fp16-mixed/stage0", "fp16-mixed/stage3", "fp16-mixed+clip_k2/stage2", "fp16-mixed+resume/stage3"} <= seen


def test_master_copies_resume_exactly(precision: Result) -> None:
    seen = set()
    for rank, key, case in _cases(precision):
        if key.startswith("bf16-master+resume"):
            assert "error" not in case, (rank, key, case)
            assert case["vs_uninterrupted"] == 0.0, (rank, key, case)
            seen.add(key)
    assert seen == {"bf16-master+resume/stage0", "bf16-master+resume/stage3"}, seen
