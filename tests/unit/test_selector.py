"""Backend selection: override, detection order, lazy registry, clear errors."""

from __future__ import annotations

import pytest

import unidist
from unidist import BackendUnavailableError, Config, ConfigError, LaunchInfo
from unidist.selector import backend_for, register, registered, select

MPICH = {"PMI_RANK": "0", "PMI_SIZE": "1"}


@pytest.mark.parametrize(("launcher", "backend"), [
    ("none", "local"), ("torchrun", "torch"), ("horovodrun", "horovod"), ("deepspeed", "deepspeed"),
    ("openmpi", "mpi"), ("mpich", "mpi"), ("mvapich", "mpi"), ("pmix", "mpi"), ("slurm", "mpi"), ("env", "torch"),
])
def test_launcher_implies_backend(launcher: str, backend: str) -> None:
    assert backend_for(Config(), LaunchInfo(launcher=launcher)) == backend


def test_override_beats_detection() -> None:
    assert backend_for(Config(backend="local"), LaunchInfo(launcher="mpich")) == "local"


def test_selects_classes() -> None:
    assert select(environ={}) is unidist.LocalManager
    assert select(environ=MPICH) is unidist.MPIManager
    assert select(environ={"UNIDIST_BACKEND": "mpi"}) is unidist.MPIManager


def test_unknown_backend_lists_registered() -> None:
    with pytest.raises(ConfigError) as info:
        select(environ={"UNIDIST_BACKEND": "nccl"})
    assert "UNIDIST_BACKEND='nccl'" in str(info.value)
    for name in ("local", "mpi"):
        assert name in str(info.value)


def test_modin_value_explained() -> None:
    with pytest.raises(ConfigError, match="Modin"):
        select(environ={"UNIDIST_BACKEND": "ray"})


def test_missing_package_gives_pip_command() -> None:
    register("fake", "no_such_module:Nope", ("no_such_engine_pkg",), "pip install no-such-engine")
    try:
        with pytest.raises(BackendUnavailableError) as info:
            select(environ={"UNIDIST_BACKEND": "fake"})
        assert isinstance(info.value, ImportError)
        assert "no_such_engine_pkg" in str(info.value)
        assert "pip install no-such-engine" in str(info.value)
    finally:
        from unidist import selector
        selector._REGISTRY.pop("fake")
    assert "fake" not in registered()


def test_init_returns_unstarted_manager() -> None:
    mgr = unidist.init(environ={})
    assert isinstance(mgr, unidist.LocalManager)
    assert not mgr.started
    with pytest.raises(unidist.NotInitializedError):
        _ = mgr.rank
    assert isinstance(unidist.init(backend="mpi", environ={}), unidist.MPIManager)
