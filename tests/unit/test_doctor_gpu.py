"""``unidist info --check`` on a GPU machine: what it says of GPUs, CUDA, NCCL, CUDA-aware MPI and each rank's device.
MOCK: no GPU here, so the GPU answers are written by hand into the report ``render`` prints (the probe's real answers
on a GPU machine are the GPU suite's); the device plan is a pure function of the environment and the GPU count."""

from __future__ import annotations

from typing import Any

from unidist.doctor import render
from unidist.doctor.verdict import device_plan

TORCHRUN_4 = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_each_local_rank_gets_a_gpu_of_its_own_while_there_are_enough() -> None:
    assert device_plan(TORCHRUN_4, 4) == {"devices": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], "gpus": 4,
                                          "shared": False}
    shared = device_plan(TORCHRUN_4, 1)
    assert shared["devices"] == ["cuda:0"] * 4 and shared["shared"]
    assert device_plan(TORCHRUN_4, 0)["devices"] == ["cpu"] * 4
    assert device_plan({**TORCHRUN_4, "UNIDIST_DEVICE": "cpu"}, 4)["devices"] == ["cpu"] * 4
    assert "no CUDA device" in device_plan({"UNIDIST_DEVICE": "cuda"}, 0)["error"]


def _report(**torch: Any) -> dict[str, Any]:
    return {"seconds": 1.0, "python": "3.12", "programs": {}, "backends": {}, "would_run": None,
            "usable_launched": [], "exit_code": 3, "network": {"interfaces": [], "variables": {}},
            "packages": {"torch": {"ok": True, "version": "2.11.0+cu130", "backends": ["gloo", "nccl"], **torch},
                         "mpi4py": {"ok": True, "version": "4.1.2", "library_version": "MPICH Version: 5.0.2",
                                    "mpi_standard": "5.0", "library": "libmpi.so", "cuda_aware": False}},
            "machine": {"cpus": 16, "usable": 16, "gpus": torch.get("gpus")},
            "nccl_variables": {"NCCL_DEBUG": "INFO"}, "devices": device_plan(TORCHRUN_4, torch.get("gpus"))}


def test_the_gpu_facts_are_printed_once_each() -> None:
    text = "\n".join(render.lines(_report(gpus=1, gpu_names=["NVIDIA H100 80GB HBM3"], cuda="13.0",
                                          driver_cuda="13.0", nccl="2.28.9")))
    assert "GPUs: 1 (NVIDIA H100 80GB HBM3); built for CUDA 13.0, driver supports CUDA 13.0; NCCL 2.28.9" in text
    assert "CUDA-aware: no (the mpi backend stages CUDA tensors through host memory)" in text
    assert "local rank 0 -> cuda:0, local rank 1 -> cuda:0" in text and "4 ranks share 1 GPU(s)" in text
    assert "NCCL variables: NCCL_DEBUG=INFO" in text
    for fact in ("NVIDIA H100", "NCCL 2.28.9", "CUDA-aware", "NCCL variables"):
        assert text.count(fact) == 1, fact


def test_a_cpu_machine_says_nothing_of_nccl() -> None:
    text = "\n".join(render.lines(_report(gpus=0, cuda=None)))
    assert "local rank 3 -> cpu" in text and "NCCL variables" not in text and "share" not in text
