"""Checkpoints real DeepSpeed wrote resume in unidist (issue 47 part 1; tests/workers/ckpt_interop.py), and the ones
the compat engine writes resume in real DeepSpeed (part 2, the last test).

Real DeepSpeed 0.19.8 under its launcher (2 ranks) writes five checkpoints with ``engine.save_checkpoint``: ZeRO 0
float32, 1 bf16, 2 float32, 2 fp16 (a loss scale of 128), 3 bf16, of a model with a tied embedding, a LayerNorm
and a buffer, AdamW, gradients clipped at 1.0 (DeepSpeed's default, active: targets of scale 10), and records
through its own calls what it saved (each float32 master and Adam moment) and where its own run ends three steps
later. Each reader loads all five at another world size, ZeRO stage or engine and must hold exactly what DeepSpeed
saved (0.0 difference: a load that put one element elsewhere, skipped the optimizer or dropped a master copy fails
here), the client state and step, and end within rounding of DeepSpeed's own continuation (float32: 1e-6; bf16,
whose gradients round differently at another world size: 3e-3 on weights of scale 4; fp16, resumed in float32:
1e-3).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import LAUNCHES, MARKS, ROOT, WORKERS, require, run
from workers.ckpt_interop_model import build

# the writer is real DeepSpeed: its env runs every reader, except Horovod's, which reads checkpoints real DeepSpeed
# wrote once into tests/data/deepspeed_written (its README says how)
DEEPSPEED = MARKS["deepspeed"]
COMMITTED = ROOT / "tests" / "data" / "deepspeed_written"

WORKER = str(WORKERS / "ckpt_interop.py")
CASES = ("0-fp32", "1-bf16", "2-fp32", "2-fp16", "3-bf16")
TOL = {"fp32": 1e-6, "bf16": 3e-3, "fp16": 1e-3}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# (reader launch, its ZeRO stage, through the compat engine): CI runs MPI at ZeRO 3, DeepSpeed's own engine and the
# compat engine; one process and torchrun (passed 2026-11-29, docs/checkpoints.md's table) with FULL_MATRIX=1
READERS = [("mpiexec-3", 3, False), ("deepspeed-2", 2, False), ("mpiexec-2", 3, True),
           *([("local-1", 0, False), ("torchrun-2", 1, False)] if os.environ.get("FULL_MATRIX") == "1" else [])]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("deepspeed")
    where = tmp_path_factory.mktemp("ds-written")
    launch = LAUNCHES["deepspeed-2"]
    proc = run(launch.command(WORKER, "--phase", "write", "--dir", str(where)), env=launch.env, timeout=600)
    assert proc.returncode == 0, proc.describe()
    return where


def _resume(written: Path, out: Path, reader: str, stage: int, cases: tuple[str, ...], compat: bool = False) -> None:
    """``reader`` at ``stage`` loads every case and trains on; what it loaded and where it ended, checked."""
    launch = LAUNCHES[reader]
    require(*launch.engines)
    proc = run(launch.command(WORKER, "--phase", "resume", "--cases", ",".join(cases), "--dir", str(written),
                              "--stage", str(stage), "--out", str(out), *(["--compat"] if compat else [])),
               env=launch.env, timeout=600)
    assert proc.returncode == 0, proc.describe()
    # the format is said in one line per load, on rank 0
    for case in cases:
        stage_of, precision = case.split("-")
        line = (f"load_checkpoint({written / case / 'global_step3'}): a DeepSpeed 0.19.8 checkpoint (ZeRO stage "
                f"{stage_of}, 2 rank(s), {DTYPES[precision]} weights, global step 3)")
        assert (proc.stdout + proc.stderr).count(line) == 1, (line, proc.describe())
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(launch.size)]
    for rank, report in enumerate(reports):
        for case in cases:
            got = report[case]
            assert (got["loaded"], got["exp_avg"], got["exp_avg_sq"]) == (0.0, 0.0, 0.0), (rank, case, got)
            assert (got["extra_step"], got["note"], got["global_steps"], got["lr"]) == (3, case, 3, 0.01), got
            assert got["final"] <= TOL[case.split("-")[1]], (rank, case, got)
            assert got["final_scale"] > 1.0, got  # the weights moved far enough that the tolerance means something


@DEEPSPEED
@pytest.mark.parametrize(("reader", "stage", "compat"), READERS,
                         ids=[f"{r}-stage{s}{'-compat' if c else ''}" for r, s, c in READERS])
def test_deepspeed_checkpoints_resume_here(written: Path, tmp_path: Path, reader: str, stage: int,
                                           compat: bool) -> None:
    _resume(written, tmp_path, reader, stage, CASES, compat)


@MARKS["horovod"]
def test_deepspeed_checkpoints_resume_under_horovodrun(tmp_path: Path) -> None:
    """ZeRO-2 float32 and ZeRO-3 bf16 checkpoints real DeepSpeed wrote (committed: the horovod env has no
    DeepSpeed), resumed under horovodrun at ZeRO 0 as the other readers are."""
    _resume(COMMITTED, tmp_path, "horovodrun-gloo-2", 0, ("2-fp32", "3-bf16"))


# ------------------------------------------------------------------------------ bad input, in this process
def _fresh(mgr: object, width: int = 32) -> tuple[object, object]:
    import torch

    import unidist

    assert isinstance(mgr, unidist.Manager)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, width), torch.nn.LayerNorm(width))
    return mgr.prepare(model, torch.optim.AdamW(model.parameters()))


@DEEPSPEED
def test_another_models_checkpoint_is_refused_naming_the_tensor(written: Path) -> None:
    import unidist

    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        model, opt = _fresh(mgr)
        with pytest.raises(unidist.CheckpointMismatchError, match=r"the model has '0.weight' \(16, 32\) but the "
                                                                  r"checkpoint does not: is it this model's\?"):
            mgr.load_checkpoint(written / "2-fp32", model, opt)


@DEEPSPEED
def test_a_truncated_or_missing_partition_is_named_and_nothing_loads(written: Path, tmp_path: Path) -> None:
    import shutil

    import torch

    import unidist

    ck = tmp_path / "ck"
    shutil.copytree(written / "3-bf16", ck)
    part = ck / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    part.write_bytes(part.read_bytes()[:1000])
    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        model = build()
        model, opt = mgr.prepare(model, torch.optim.AdamW(model.parameters()), precision="bf16-master")
        before = {k: v.clone() for k, v in mgr.unwrap(model).state_dict().items()}
        with pytest.raises(unidist.CheckpointCorruptError, match=f"{part} cannot be read"):
            mgr.load_checkpoint(ck, model, opt)
        assert all(torch.equal(v, before[k]) for k, v in mgr.unwrap(model).state_dict().items())  # nothing loaded
        part.unlink()
        with pytest.raises(unidist.CheckpointCorruptError, match=f"{part} is missing: the checkpoint was written by 2 "
                                                                 "ranks"):
            mgr.load_checkpoint(ck, model, opt)


@DEEPSPEED
@pytest.mark.parametrize("case", CASES)
def test_export_equals_deepspeeds_own_consolidation(written: Path, tmp_path: Path, case: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``unidist checkpoint export`` of what DeepSpeed wrote is what DeepSpeed's own zero_to_fp32 makes of it (the
    module's state dict at stage 0, where that tool does not apply), bit for bit, read back by safetensors."""
    import torch
    from safetensors.torch import load_file

    from unidist.cli import main

    assert main(["checkpoint", "inspect", str(written / case)]) == 0
    said = capsys.readouterr().out
    assert "check pieces: " in said and "FAILED" not in said, said
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", str(written / case), str(out)]) == 0
    got = load_file(out)
    if case.startswith("0-"):
        want = torch.load(written / case / "global_step3" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        want = get_fp32_state_dict_from_zero_checkpoint(str(written / case))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@DEEPSPEED
def test_a_script_trained_here_goes_back_to_deepspeed(tmp_path: Path) -> None:
    """The other way (issue 47 part 2): the same five cases trained off DeepSpeed by unidist.compat.deepspeed (under
    torchrun, gloo, no DeepSpeed engine) and saved by its ``engine.save_checkpoint``, which writes DeepSpeed's own
    files; real DeepSpeed under its launcher resumes each at the stage it was written at (DeepSpeed's rule) with
    ``engine.load_checkpoint``: exactly the saved weights, the client state and counters, and a continuation within
    rounding of the compat run's own (the optimizer's moments show there: DeepSpeed 0.19.8 cannot report ZeRO's
    before its first step). With FULL_MATRIX=1 unidist then reads the same files through the compat engine at 3
    ranks and ZeRO 3."""
    require("deepspeed", "mpi4py")
    writer, deepspeed = LAUNCHES["torchrun-2"], LAUNCHES["deepspeed-2"]
    proc = run(writer.command(WORKER, "--phase", "write", "--compat", "--dir", str(tmp_path)), env=writer.env,
               timeout=600)
    assert proc.returncode == 0, proc.describe()
    assert sorted(p.name for p in (tmp_path / "2-fp32" / "global_step3").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert sorted(p.name for p in (tmp_path / "3-bf16" / "global_step3").iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    out = tmp_path / "out"
    out.mkdir()
    proc = run(deepspeed.command(WORKER, "--phase", "resume-deepspeed", "--dir", str(tmp_path), "--out", str(out)),
               env=deepspeed.env, timeout=600)
    assert proc.returncode == 0, proc.describe()
    for rank in range(deepspeed.size):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["backend"] == "deepspeed", report
        for case in CASES:
            got = report[case]
            zero = case[0] != "0"
            assert got["loaded"] == 0.0, (rank, case, got)
            assert (got["exp_avg"], got["exp_avg_sq"]) == ((None, None) if zero else (0.0, 0.0)), (rank, case, got)
            assert (got["extra_step"], got["note"], got["global_steps"], got["lr"]) == (3, case, 3, 0.01), got
            assert got["final"] <= TOL[case.split("-")[1]], (rank, case, got)
            assert got["final_scale"] > 1.0, got
    # CI time (passed 2026-11-29): tests/unit/test_checkpoint_deepspeed_writer.py reads the writer's files back
    if os.environ.get("FULL_MATRIX") == "1":
        (tmp_path / "out3").mkdir()
        _resume(tmp_path, tmp_path / "out3", "mpiexec-3", 3, CASES, compat=True)
