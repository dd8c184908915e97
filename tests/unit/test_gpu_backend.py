"""What a CPU-only machine can check of the GPU set-up. MOCK: no GPU exists here, so the device is set by hand
on a Manager that is never started; tests/multiproc/test_gpu.py runs the real thing where CUDA is present."""

from __future__ import annotations

import torch

from unidist import Config, LaunchInfo
from unidist.managers.torch import TorchManager


def test_cuda_runs_get_gloo_beside_nccl_for_cpu_tensors() -> None:
    m = TorchManager(Config(), LaunchInfo())
    assert m._process_group_backend() == "gloo"
    m._device = torch.device("cuda", 1)  # mock: what _pick_device returns on a GPU node
    assert m._process_group_backend() == "cpu:gloo,cuda:nccl"
