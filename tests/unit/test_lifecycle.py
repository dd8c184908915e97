"""Lifecycle rules every Manager shares (exercised on LocalManager; no other Manager may be active)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unidist
from unidist import Config, LaunchInfo, NotInitializedError, UnidistError
from unidist.managers.base import get_manager

# The rules here hold on any device; stated as the CPU so that a GPU machine runs the same test (the auto rule,
# cuda:N where torch sees a GPU, is the collective suite's topology case: test_local.py)
CPU = Config(device="cpu")
ON_CPU = {"UNIDIST_DEVICE": "cpu"}


def test_lifecycle() -> None:
    m = unidist.LocalManager(CPU, LaunchInfo())
    with pytest.raises(NotInitializedError):
        get_manager()
    with m as entered:
        assert entered is m
        assert get_manager() is m
        assert (m.rank, m.size, m.local_rank, m.local_size, m.node_rank, m.is_main) == (0, 1, 0, 1, 0, True)
        assert m.backend == "local"
        assert m.device == torch.device("cpu")
        with pytest.raises(UnidistError, match="already started"), m:
            pass
        with pytest.raises(UnidistError, match="another Manager"):
            unidist.LocalManager(CPU, LaunchInfo()).start()
    assert not m.started
    with pytest.raises(NotInitializedError):
        get_manager()
    m.shutdown()  # twice is fine


def test_exit_never_swallows() -> None:
    with pytest.raises(KeyError), unidist.LocalManager(CPU, LaunchInfo()):
        raise KeyError("boom")
    with pytest.raises(NotInitializedError):
        get_manager()


def test_start_and_shutdown_without_with() -> None:
    m = unidist.init(environ=ON_CPU)
    m.start()
    try:
        assert m.allreduce(np.ones(3)).tolist() == [1.0, 1.0, 1.0]
    finally:
        m.shutdown()


def test_refuses_a_multi_process_launch() -> None:
    m = unidist.LocalManager(Config(backend="local", device="cpu"),
                             LaunchInfo(rank=0, size=2, local_size=2, launcher="mpich"))
    with pytest.raises(unidist.LaunchEnvironmentError, match="started 2"):
        m.start()
    assert not m.started


def test_device_cuda_refused_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(unidist.ConfigError, match="UNIDIST_DEVICE='cuda'"):
        unidist.LocalManager(Config(device="cuda"), LaunchInfo()).start()
