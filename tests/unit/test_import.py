"""``import unidist`` stays light: no engine, no MPI start, not even torch."""

from __future__ import annotations

import subprocess
import sys

import unidist


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_loads_no_backend() -> None:
    mods = _loaded_after("import unidist")
    for heavy in ("mpi4py", "horovod", "deepspeed", "torch"):
        assert not any(m == heavy or m.startswith(heavy + ".") for m in mods), heavy


def test_init_under_no_launcher_loads_no_engine() -> None:
    mods = _loaded_after("import unidist\nmgr = unidist.init()")
    assert not any(m.startswith(("mpi4py", "horovod", "deepspeed")) for m in mods)


def test_error_family() -> None:
    for cls in (unidist.BackendUnavailableError, unidist.NotInitializedError, unidist.LaunchEnvironmentError,
                unidist.ConfigError, unidist.CollectiveMismatchError, unidist.CollectiveTimeoutError,
                unidist.InvalidArgumentError):
        assert issubclass(cls, unidist.UnidistError)
    assert issubclass(unidist.BackendUnavailableError, ImportError)
    assert unidist.ReduceOp("mean") is unidist.ReduceOp.MEAN
