"""The tests' own import path, and the backends the test tree ships (tests/backends/, one file each).

tests/backends/ is put on PYTHONPATH for every process the tests start, as an installed plugin package would
be on a user's: its ``unidist_test_backends-0.dist-info`` declares the ``unidist.backends`` entry points, so a
launched script selects such a backend with ``UNIDIST_BACKEND`` alone. Here, in the test process, each is
looked up once so that its record (and its launches) is registered before tests/helpers.py reads the table.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

HERE = Path(__file__).resolve().parent
BACKENDS = HERE / "backends"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(BACKENDS))
# a launched worker sees its own directory and imports its siblings by name (common, zero); a test importing a
# worker's constants must find them too
sys.path.append(str(HERE / "workers"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(BACKENDS), *filter(None, [os.environ.get("PYTHONPATH")])])


def _register_test_backends() -> None:
    from unidist import registry

    for ep in entry_points(group=registry.ENTRY_POINTS):
        if ep.dist is not None and ep.dist.name == "unidist-test-backends":
            registry.get(ep.name)


_register_test_backends()


def pytest_configure(config: object) -> None:
    """Each test backend's tests carry a mark of its name (tests/helpers.py MARKS): declare it."""
    from unidist import registry

    known = {"local", "mpi", "torch", "deepspeed", "horovod"}
    for name in registry.names():
        if name not in known:
            config.addinivalue_line("markers", f"{name}: runs real processes on the {name} backend (tests/backends/)")  # type: ignore[attr-defined]
