"""What a CPU-only machine can check of the GPU set-up. MOCK: no GPU exists here, so the device is set by hand
on a Manager that is never started; tests/multiproc/test_gpu.py runs the real thing where CUDA is present."""

from __future__ import annotations

import torch

from unidist import Config, LaunchInfo
from unidist.engines.torch.manager import TorchManager


def test_cuda_runs_get_gloo_beside_nccl_for_cpu_tensors() -> None:
    m = TorchManager(Config(), LaunchInfo())
    assert m._process_group_backend() == "gloo"
    m._device = torch.device("cuda", 1)  # mock: what _pick_device returns on a GPU node
    assert m._process_group_backend() == "cpu:gloo,cuda:nccl"


def test_ranks_sharing_a_gpu_get_gloo_alone_and_host_staging() -> None:
    """MOCK (the device and the shared flag set by hand): more ranks than GPUs on a host cannot use NCCL."""
    from unidist.engines.torch.manager import HostStagedTorchEngine, shares_gpus

    assert shares_gpus(torch.device("cuda", 0), local_size=2, gpus=1)
    assert not shares_gpus(torch.device("cuda", 0), local_size=2, gpus=2)
    assert not shares_gpus(torch.device("cpu"), local_size=4, gpus=1)
    m = TorchManager(Config(), LaunchInfo())
    m._device, m._shared_gpu = torch.device("cuda", 0), True
    assert m._process_group_backend() == "gloo"
    seen: list[torch.Tensor] = []
    send, recv = torch.ones(2), torch.zeros(2)
    HostStagedTorchEngine._staged(object.__new__(HostStagedTorchEngine), lambda s, r: seen.extend([s, r]), send,
                                  recv)
    assert seen[0] is send and seen[1] is recv  # CPU tensors go straight through: nothing to stage


def test_deepspeed_refuses_ranks_sharing_a_gpu_before_any_rendezvous(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """MOCK: torch is told it has one GPU and set_device does nothing; two ranks of one host then start."""
    import pytest

    pytest.importorskip("deepspeed")
    from unidist import LaunchEnvironmentError
    from unidist.engines.deepspeed.manager import DeepSpeedManager

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    launch = LaunchInfo(rank=1, size=2, local_rank=1, local_size=2, launcher="deepspeed")
    with pytest.raises(LaunchEnvironmentError, match=r"2 ranks share 1 GPU\(s\).*deepspeed --num_gpus 1"):
        DeepSpeedManager(Config(), launch).start()
