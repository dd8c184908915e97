"""Backend selection: override, detection order, lazy registry, clear errors."""

from __future__ import annotations

import pytest

import unidist
from unidist import BackendUnavailableError, Config, ConfigError, LaunchInfo
from unidist.launch import LAUNCHERS, backend_of, command_family
from unidist.selector import backend_for, register, registered, select, spec, unregister

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
        unregister("fake")
    assert "fake" not in registered()


def test_registry_refuses_duplicates() -> None:
    with pytest.raises(ConfigError, match=r"already registered \(unidist.managers.mpi:MPIManager\).*replace=True"):
        register("mpi", "my_plugin:FastMPI")
    assert spec("mpi").target == "unidist.managers.mpi:MPIManager"
    register("mine", "a:B")
    try:
        register("mine", "c:D", replace=True)
        assert spec("mine").target == "c:D"
    finally:
        unregister("mine")
    with pytest.raises(ConfigError, match="non-empty"):
        register("", "a:B")


def test_launcher_table_is_consistent() -> None:
    """Every family implies a registered backend; MPI-like ones imply mpi; each backend unidist launch
    drives has exactly one command row."""
    for fam in LAUNCHERS:
        assert fam.backend in registered(), fam
        assert backend_of(fam.name) == fam.backend
        assert not fam.mpi_like or fam.backend == "mpi", fam
    assert backend_of("none") == "local"
    drivable = [fam.backend for fam in LAUNCHERS if fam.command is not None]
    assert sorted(drivable) == sorted(set(drivable)) == ["deepspeed", "horovod", "mpi", "torch"]
    for backend in drivable:
        fam = command_family(backend)
        assert fam is not None and fam.command is not None
        argv = fam.command.argv("prog", 3, "py", 1234, ["s.py", "--x"])
        assert argv[0] == "prog" and argv[-2:] == ["s.py", "--x"] and "3" in " ".join(argv)
        assert not any("{" in a for a in argv), argv


def test_init_returns_unstarted_manager() -> None:
    mgr = unidist.init(environ={})
    assert isinstance(mgr, unidist.LocalManager)
    assert not mgr.started
    with pytest.raises(unidist.NotInitializedError):
        _ = mgr.rank
    assert isinstance(unidist.init(backend="mpi", environ={}), unidist.MPIManager)
