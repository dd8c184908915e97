"""Backend selection: override, detection order, lazy registry, clear errors."""

from __future__ import annotations

import pytest

import unidist
from unidist import BackendUnavailableError, Config, ConfigError, LaunchInfo, registry
from unidist.engines import unidist_training
from unidist.launch import LAUNCHERS, family
from unidist.registry import Backend, Launch
from unidist.selector import backend_for, create, select

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


@pytest.mark.parametrize(("given", "meant"), [("mpii", "mpi"), ("pytorch", "torch"), ("deepspeeed", "deepspeed"),
                                              ("horovd", "horovod"), ("nccl", "torch"), ("mpi4py", "mpi")])
def test_a_misspelt_backend_gets_did_you_mean(given: str, meant: str) -> None:
    said = rf"UNIDIST_BACKEND='{given}' is not a registered backend.*did you mean '{meant}'"
    with pytest.raises(ConfigError, match=said):
        select(environ={"UNIDIST_BACKEND": given})


def test_a_name_far_from_every_backend_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as info:
        select(environ={"UNIDIST_BACKEND": "zzz"})
    assert "did you mean" not in str(info.value)


def test_modin_value_explained() -> None:
    with pytest.raises(ConfigError, match="Modin"):
        select(environ={"UNIDIST_BACKEND": "ray"})


def _record(name: str, **kw: object) -> Backend:
    fields: dict[str, object] = {"manager_name": "LocalManager", "manager": lambda: unidist.LocalManager,
                                 "strategy": unidist_training}
    fields.update(kw)
    return Backend(name=name, **fields)  # type: ignore[arg-type]


def test_missing_package_gives_pip_command() -> None:
    registry.register(_record("fake", requires=("no_such_engine_pkg",), install="pip install no-such-engine"))
    try:
        with pytest.raises(BackendUnavailableError) as info:
            select(environ={"UNIDIST_BACKEND": "fake"})
        assert isinstance(info.value, ImportError)
        assert "no_such_engine_pkg" in str(info.value)
        assert "pip install no-such-engine" in str(info.value)
    finally:
        registry.unregister("fake")
    assert "fake" not in registry.names()


def test_registry_refuses_duplicates_and_bad_records() -> None:
    with pytest.raises(ConfigError, match=r"'mpi' is already registered.*replace=True"):
        registry.register(_record("mpi"))
    assert registry.get("mpi").manager_name == "MPIManager"
    registry.register(_record("mine"))
    try:
        registry.register(_record("mine", install="x"), replace=True)
        assert registry.get("mine").install == "x"
    finally:
        registry.unregister("mine")
    with pytest.raises(ConfigError, match="non-empty"):
        registry.register(_record(""))
    with pytest.raises(ConfigError, match="already implies the 'mpi' backend"):
        registry.register(_record("mine", implied_by=("mpich",)))
    with pytest.raises(ConfigError, match="launcher family 'srun'"):
        registry.register(_record("mine", launches=(Launch("srun", "srun-{n}"),)))
    assert "mine" not in registry.names()


def test_a_registered_backend_is_chosen_and_handed_its_strategy() -> None:
    class Strategy:
        def __init__(self, mgr: object) -> None:
            self.mgr = mgr

        @staticmethod
        def latest_checkpoint(directory: object) -> str:
            return f"latest in {directory}"

    registry.register(_record("mine", strategy=lambda: Strategy))
    try:
        mgr = create(environ={"UNIDIST_BACKEND": "mine"})
        assert isinstance(mgr, unidist.LocalManager)
        assert mgr.latest_checkpoint("d") == "latest in d"
        with mgr:
            assert isinstance(mgr._training(), Strategy)
    finally:
        registry.unregister("mine")


def test_launcher_table_and_records_agree() -> None:
    """Every launcher family implies exactly one registered backend, MPI-like ones mpi; each backend's
    launcher has a command line that spells a well-formed argv."""
    for fam in LAUNCHERS:
        implied = [r.name for r in registry.records() if fam.name in r.implied_by]
        assert len(implied) == 1, (fam.name, implied)
        assert not fam.mpi_like or implied == ["mpi"], fam
    assert registry.for_launcher("none") == "local"
    for record in registry.records():
        if record.launcher is None:
            continue
        fam = family(record.launcher)
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
