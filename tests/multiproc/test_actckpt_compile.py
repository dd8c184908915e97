"""Activation checkpointing and torch.compile under the real launchers (tests/workers/actckpt_compile.py).

One launch per backend runs every variant. Activation checkpointing (use_reentrant True and False) on every
backend's main 2-rank launch: at ZeRO stage 0, 2 and 3 (DeepSpeed: its engine's ZeRO) and inside a 2-stage
Pipeline, the weights equal the same run without checkpointing and one plain-torch process on the full batch,
and the first forward saves fewer activation bytes for backward. torch.compile (before and after prepare) at
ZeRO stage 0, 2 and 3 trains to eager's weights on every backend, except a compiled module handed to DeepSpeed's
ZeRO-3 engine: prepare refuses it with an InvalidArgumentError that says to compile the engine instead.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, main_launches, require, results, run
from workers.actckpt_compile import MODES, STAGES, STEPS

WORKER = str(WORKERS / "actckpt_compile.py")
CKPT_LAUNCHES = list(main_launches(2))
# torch.compile on the built-in backends (a backend registered from outside, such as the tests' mpi_pickle, runs
# the same prepare as mpi: checkpointing covers it)
COMPILE_BACKENDS = ("mpi", "torch", "deepspeed", "horovod")
# checkpointing inside pipeline stages is parallel/'s code over send/recv, the same on every engine (test_parallel
# runs the pipelines on each); Horovod's send/recv goes through a store (its part cost ~40 s of CI): mpi and torch
PIPE_BACKENDS = ("mpi", "torch")
# DeepSpeed's engine ZeRO-3 cannot run a compiled module (its hooks fail inside it): prepare refuses it
REFUSED = {("deepspeed", "before", 3)}
REF_TOL = 1e-5  # float32 against one process on the full batch (the ranks' mean of two half-batch gradients)
SAME_TOL = 1e-6  # against the same run without checkpointing / eagerly: the same float ops (0.0 measured)
Result = tuple[Launch, Run, dict[int, dict[str, Any]]]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in CKPT_LAUNCHES])
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Result:
    launch = LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(request.param)
    parts = ",".join(["ckpt", *(["pipe"] if launch.backend in PIPE_BACKENDS else []),
                      *(["compile"] if launch.backend in COMPILE_BACKENDS else [])])
    proc = run(launch.command(WORKER, "--out", str(out), "--parts", parts), env=launch.env, timeout=600)
    return launch, proc, results(out, launch.size)  # type: ignore[return-value]


def _get(res: Result, key: str) -> list[dict[str, Any]]:
    launch, proc, got = res
    assert proc.returncode == 0, proc.describe()
    assert sorted(got) == list(range(launch.size)), proc.describe()
    rows = [got[rank][key] for rank in range(launch.size)]
    for rank, row in enumerate(rows):
        assert "error" not in row, f"rank {rank} {key}: {row['error']}\n{proc.describe()}"
    return rows


def test_launch(launched: Result) -> None:
    launch, proc, got = launched
    assert proc.returncode == 0, proc.describe()
    assert got[0]["_meta"]["backend"] == launch.backend
    assert got[0]["ckpt/_reference"]["first_norm"] > 5  # an engine clipping at 1.0 would show
    assert got[0]["ckpt/_reference"]["plain_ckpt_vs_plain"] == 0.0  # checkpointing in plain torch: same math


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_trains_the_same(launched: Result, mode: str, stage: int) -> None:
    rows = _get(launched, f"ckpt/{mode}/stage{stage}")
    none = _get(launched, f"ckpt/none/stage{stage}")
    for rank, (row, base) in enumerate(zip(rows, none, strict=True)):
        assert row["diff"] <= REF_TOL, (rank, row)
        assert row["vs_none"] <= SAME_TOL, (rank, row)
        assert row["spread"] == 0.0, (rank, row)  # ranks agree bitwise
        if mode != "none":  # the blocks' inner activations are not kept: recomputed in backward
            assert row["saved_bytes"] < 0.75 * base["saved_bytes"], (rank, row, base)
        # each block runs again in every backward (STEPS x 2 blocks); at stage 3 its weights were released after
        # the forward, so each recompute started from an empty parameter and gathered again
        assert row["recomputes"] == (0 if mode == "none" else STEPS * 2), (rank, row)
        if stage == 3 and mode != "none" and launched[0].backend == "deepspeed":  # prefetches after a traced step
            assert 0 < row["recomputed_from_empty"] <= row["recomputes"], (rank, row)
        elif stage == 3 and mode == "nonreentrant":
            # the block's forward ran with grad enabled, so the hook on its output gathered the block again before
            # autograd reached the recompute (reentrant checkpointing runs the forward under no_grad: no hook)
            assert row["recomputed_from_empty"] == 0, (rank, row)
        else:
            assert row["recomputed_from_empty"] == (row["recomputes"] if stage == 3 else 0), (rank, row)
    print(f"{launched[0].backend} {mode} stage {stage}: diff {rows[0]['diff']:.2e} vs_none {rows[0]['vs_none']:.2e} "
          f"saved {rows[0]['saved_bytes']} B (without checkpointing {none[0]['saved_bytes']} B), "
          f"{rows[0]['recomputes']} recomputed block forwards, {rows[0]['recomputed_from_empty']} from released")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_in_pipeline_stages(launched: Result, mode: str, schedule: str) -> None:
    if launched[0].backend not in PIPE_BACKENDS:
        pytest.skip(f"checkpointing in pipeline stages is covered on {', '.join(PIPE_BACKENDS)}")
    rows = _get(launched, f"pipe/{schedule}/{mode}")
    for rank, row in enumerate(rows):
        assert row["params"] == 6, (rank, row)  # this stage's block (4) and its stem or head (2)
        assert row["diff"] <= REF_TOL, (rank, row)
        assert row["vs_none"] <= SAME_TOL, (rank, row)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", ["before", "after"])
def test_compiled_trains_like_eager(launched: Result, how: str, stage: int) -> None:
    if launched[0].backend not in COMPILE_BACKENDS:
        pytest.skip(f"torch.compile is covered on {', '.join(COMPILE_BACKENDS)}")
    if (launched[0].backend, how, stage) in REFUSED:
        pytest.skip("refused: test_compiled_module_refused_by_deepspeed_zero3")
    rows = _get(launched, f"compile/{how}/stage{stage}")
    for rank, row in enumerate(rows):
        assert row["diff"] <= REF_TOL, (rank, row)
        assert row["vs_eager"] <= SAME_TOL, (rank, row)
        assert row["spread"] == 0.0, (rank, row)
        assert row["graphs"] >= 1 and row["ops"] >= 1, (rank, row)  # dynamo did compile something
    print(f"{launched[0].backend} compile {how} prepare, stage {stage}: diff {rows[0]['diff']:.2e} vs eager "
          f"{rows[0]['vs_eager']:.2e}, {rows[0]['graphs']} graphs / {rows[0]['ops']} ops, {rows[0]['seconds']:.2f} s")


def test_compiled_module_refused_by_deepspeed_zero3(launched: Result) -> None:
    launch, proc, got = launched
    if launch.backend != "deepspeed":
        pytest.skip("only DeepSpeed's engine ZeRO-3 refuses a compiled module")
    assert proc.returncode == 0, proc.describe()
    for rank in range(launch.size):
        row = got[rank]["compile/before/stage3"]
        assert row.get("type") == "InvalidArgumentError", (rank, row)
        assert "torch.compile(engine)" in row["error"], (rank, row)  # says what to do instead
