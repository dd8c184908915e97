"""The GPU suite (``pytest -m gpu``): what a one-GPU machine can check, in a few minutes; every test skips with a
reason where torch sees no CUDA device. Run it with ``python3 -m pytest -m gpu tests`` on the GPU machine
(../shared/gpu/README.md says how to bring the engines there).

Launches on one GPU: torchrun at one rank (nccl), torchrun at two ranks sharing the GPU (gloo, CUDA tensors staged
through the host: engines/torch/manager.py ``HostStagedTorchEngine``), mpiexec at two ranks (MPI's host staging, or
CUDA-aware MPI), deepspeed at one rank (its engine on the GPU). Per launch, the same workers as the CPU suites,
on the GPU: the collective suite with CUDA inputs (``--on-device``, every dtype, sampled), ``prepare(precision=)``
in every mode against ``torch.autocast("cuda")`` + ``GradScaler("cuda")``, and where there are two ranks tensor
and pipeline parallelism; the model zoo on one GPU is tests/multiproc/test_model_zoo.py's ``test_zoo_on_one_gpu``.
Checkpoints go GPU -> CPU and CPU -> GPU, and a compat script trains on CUDA. What a CPU machine can check of the
GPU set-up is tests/unit/test_gpu_backend.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import LAUNCHES, WORKERS, Launch, require, results, run, torchrun

pytestmark = [pytest.mark.gpu]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# UNIDIST_TEST_GPU_REHEARSAL=1 runs the suite's launches on the CPU: a rehearsal of the script before a scarce GPU
# visit (a typo there costs minutes of GPU time), not a GPU check (the CUDA-only assertions are skipped)
REHEARSAL = os.environ.get("UNIDIST_TEST_GPU_REHEARSAL") == "1"
needs_gpu = pytest.mark.skipif(_gpus() == 0 and not REHEARSAL,
                               reason="needs a CUDA device; torch sees none on this machine")

# (id, launch, mark): every way a one-GPU machine runs unidist
GPU_LAUNCHES = {
    "torchrun-1-nccl": (LAUNCHES["torchrun-2"].resized(1), pytest.mark.torch),
    "torchrun-2-one-gpu": (LAUNCHES["torchrun-2"], pytest.mark.torch),
    "mpiexec-2-one-gpu": (LAUNCHES["mpiexec-2"], pytest.mark.mpi),
    "deepspeed-1": (LAUNCHES["deepspeed-2"].resized(1), pytest.mark.deepspeed),
}


def _params(ids: list[str]) -> list[Any]:
    return [pytest.param(i, marks=[GPU_LAUNCHES[i][1]]) for i in ids]


def _launch(launch_id: str, worker: str, out: Path, *args: str, timeout: float = 600) -> dict[int, dict[str, Any]]:
    launch: Launch = GPU_LAUNCHES[launch_id][0]
    require(*launch.engines)
    proc = run(launch.command(str(WORKERS / worker), "--out", str(out), *args), env=launch.env, timeout=timeout)
    assert proc.returncode == 0, proc.describe()
    got = results(out, launch.size)
    assert sorted(got) == list(range(launch.size)), proc.describe()
    return got


@pytest.mark.skipif(_gpus() == 0, reason="needs a CUDA device; torch sees none on this machine")
@pytest.mark.torch
def test_torch_backend_on_cuda(tmp_path: Path) -> None:
    require("torch")
    n = min(2, _gpus())  # nccl needs one GPU per rank
    proc = run(torchrun(n, str(WORKERS / "gpu_contract.py"), "--out", str(tmp_path)), timeout=600)
    assert proc.returncode == 0, proc.describe()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    for rank, r in enumerate(reports):
        assert r["device"] == f"cuda:{rank}"
        assert r["param_spread"] == 0.0, r
        assert r["state_devices"] == [f"cuda:{rank}"], r  # broadcast optimizer state lands on this rank's GPU
        assert r["allgather"] == [[float(k), float(k)] for k in range(n) for _ in range(k + 1)]
        assert r["mean"] == pytest.approx((n - 1) / 2)
        assert r["object"] == {"from": n - 1}
        assert r["cpu_allreduce"] == [n * (n + 1) / 2] * 3


@needs_gpu
@pytest.mark.parametrize("launch_id", _params(list(GPU_LAUNCHES)))
def test_collectives_on_cuda_tensors(launch_id: str, tmp_path: Path) -> None:
    """The collective suite with its torch inputs on the GPU (every dtype and op, about 12 cases a collective):
    results equal the numpy reference and stay on the GPU."""
    got = _launch(launch_id, "collectives.py", tmp_path, "--on-device", "--sample")
    for rank, report in got.items():
        failed = {k: v for k, v in report.items() if isinstance(v, str) and v.startswith("FAIL")}
        assert not failed, (rank, failed)
        assert sum(v == "ok" for v in report.values()) > 100, rank


@needs_gpu
@pytest.mark.parametrize("launch_id", _params(["torchrun-1-nccl", "torchrun-2-one-gpu", "mpiexec-2-one-gpu"]))
def test_precision_against_cuda_autocast_and_gradscaler(launch_id: str, tmp_path: Path) -> None:
    """Every precision mode at ZeRO 0-3 against one process with torch.autocast("cuda") and GradScaler("cuda"):
    the same weights (tests/multiproc/test_precision.py's bounds) and, in fp16, the same skipped steps and
    scales."""
    got = _launch(launch_id, "precision.py", tmp_path)
    for rank, report in got.items():
        for key, r in report.items():
            if key.startswith("_"):
                continue
            assert "error" not in r, (rank, key, r)
            assert r["spread"] == 0.0, (rank, key, r)
            tol = 5e-2 if key.startswith("bf16-true") else 1e-3 if "16" in key else 1e-5
            assert r["diff"] <= tol, (rank, key, r)
            if key.startswith("fp16"):
                assert r["seq"] == r["want_seq"], (rank, key, r)


@needs_gpu
@pytest.mark.parametrize("launch_id", _params(["torchrun-2-one-gpu", "mpiexec-2-one-gpu"]))
def test_tensor_and_pipeline_parallel_on_cuda(launch_id: str, tmp_path: Path) -> None:
    got = _launch(launch_id, "parallel.py", tmp_path)
    for rank, report in got.items():
        failed = {k: v["result"] for k, v in report.items() if isinstance(v, dict) and v.get("result") != "ok"}
        assert not failed, (rank, failed)


@needs_gpu
@pytest.mark.parametrize("launch_id", _params(["torchrun-1-nccl", "mpiexec-2-one-gpu", "deepspeed-1"]))
def test_offload_trains_the_same_with_less_device_memory(launch_id: str, tmp_path: Path) -> None:
    """prepare(offload="cpu") at ZeRO 1-3 (tests/workers/offload.py): the weights of no offload (Adam stepped by the
    CPU's kernels instead of the GPU's: within 1e-5), the optimizer state in pinned host memory, and the device peak
    lower by at least half the Adam state it moved (DeepSpeed: its own offload_optimizer/offload_param)."""
    got = _launch(launch_id, "offload.py", tmp_path)
    for rank, report in got.items():
        on_gpu = report["_meta"]["device"].startswith("cuda")
        for stage in (1, 2, 3):
            r = report[f"stage{stage}"]
            plain, moved = r["plain"], r["offload"]
            assert r["diff"] <= (1e-5 if on_gpu else 0.0), (rank, stage, r)
            assert not plain["offloaded"], (rank, stage, r)
            if not on_gpu:  # the rehearsal: unidist's host path ran on the CPU (DeepSpeed's CPU run is the no-op)
                assert moved["offloaded"] == (report["_meta"]["backend"] != "deepspeed"), (rank, stage, r)
                continue
            assert moved["offloaded"], (rank, stage, r)
            if report["_meta"]["backend"] != "deepspeed":  # DeepSpeed keeps its CPU state in its own optimizer
                assert moved["state_devices"] == ["cpu"] and moved["state_pinned"], (rank, stage, r)
            assert moved["peak"] <= plain["peak"] - plain["state_bytes"] / 2, (rank, stage, r)


CKPT_CELLS = "gpt2:3:32,resnet_syncbn:1:32,lora:2:32,shared:0:32"


@needs_gpu
@pytest.mark.torch
def test_checkpoints_move_between_gpu_and_cpu(tmp_path: Path) -> None:
    """A checkpoint saved on the GPU loads in a CPU-only process, and one saved there loads on the GPU (the model
    zoo's resume: the same weights, tied names tied)."""
    gpu, cpu = LAUNCHES["torchrun-2"].resized(1), LAUNCHES["local-1"]
    require(*gpu.engines, "transformers")
    for saver, loader, env in ((gpu, cpu, {"UNIDIST_DEVICE": "cpu"}), (cpu, gpu, {})):
        saved, resumed = tmp_path / f"{saver.backend}-saved", tmp_path / f"{saver.backend}-resumed"
        saved.mkdir()
        resumed.mkdir()
        first_env = {**saver.env, **({"UNIDIST_DEVICE": "cpu"} if saver is cpu else {})}
        proc = run(saver.command(str(WORKERS / "model_zoo.py"), "--out", str(saved), "--cells", CKPT_CELLS),
                   env=first_env, timeout=600)
        assert proc.returncode == 0, proc.describe()
        proc = run(loader.command(str(WORKERS / "model_zoo.py"), "--out", str(resumed), "--cells", "none",
                                  "--resume-from", str(saved)), env={**loader.env, **env}, timeout=600)
        assert proc.returncode == 0, proc.describe()
        report = results(resumed, 1)[0]
        got = {k: v for k, v in report.items() if k.startswith("resume/")}
        assert len(got) == len(CKPT_CELLS.split(",")), sorted(got)
        for key, r in got.items():
            assert r["diff"] == 0.0 and r["ints_equal"] and r["tied"], (saver.backend, key, r)


@needs_gpu
@pytest.mark.torch
def test_a_horovod_script_trains_on_cuda(tmp_path: Path) -> None:
    """Horovod's MNIST example through unidist.compat.horovod on the GPU (it uses CUDA when it sees it), under
    torchrun at one rank: it runs to the end and learns (real Horovod is not on the GPU machine to compare)."""
    import shutil

    from test_hvd_examples import COMPAT_IMPORT, EXAMPLES, REAL_IMPORT

    require("torch", "sklearn")
    lines = (EXAMPLES / "pytorch_mnist.py").read_text().replace(REAL_IMPORT, COMPAT_IMPORT)
    lines = "\n".join(line for line in lines.splitlines() if line.strip() != "import horovod")
    (tmp_path / "pytorch_mnist.py").write_text(lines)
    shutil.copy(EXAMPLES / "harness.py", tmp_path / "harness.py")
    launch = LAUNCHES["torchrun-2"].resized(1)
    proc = run(launch.command(str(tmp_path / "pytorch_mnist.py"), "--out", str(tmp_path / "out")), env=launch.env,
               cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.describe()
    assert "Test set: Average loss" in proc.stdout, proc.describe()


@needs_gpu
@pytest.mark.mpi
def test_verify_agrees_on_the_gpu(tmp_path: Path) -> None:
    """`unidist verify` on one GPU: the main example as one process on CUDA, under torchrun at one rank (NCCL) and
    under mpiexec at two ranks sharing the GPU (host staging) trains the same, step by step, within the rounding
    envelope its two perturbed one-process runs measure on the GPU; the fingerprints say where each ran."""
    import subprocess
    import sys

    require("torch", "mpi4py", "sklearn")
    out = tmp_path / "fp"
    proc = subprocess.run([sys.executable, "-m", "unidist.cli", "verify", "--json", "--out-dir", str(out),
                           "--launch", "torchrun --standalone --nproc_per_node 1", "--launch", "mpiexec -n 2",
                           "examples/train_digits.py", "--epochs", "1"],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert [e["status"] for e in result["launches"]] == ["reference", "agrees", "agrees"], result
    labels = [e["label"] for e in result["launches"] + result["rounding_runs"]]  # the rounding re-runs too
    devices = [json.loads((out / f"{label}.jsonl").read_text().splitlines()[0]).get("device") for label in labels]
    assert len(devices) == 5 and (REHEARSAL or all(str(d).startswith("cuda") for d in devices)), devices
