"""The tests' own import path, and the backends the test tree ships (tests/backends/, one file each).

tests/backends/ is put on PYTHONPATH for every process the tests start, as an installed plugin package would
be on a user's: its ``unidist_test_backends-0.dist-info`` declares the ``unidist.backends`` entry points, so a
launched script selects such a backend with ``UNIDIST_BACKEND`` alone. Here, in the test process, each is
looked up once so that its record (and its launches) is registered before tests/helpers.py reads the table.

``UNIDIST_TEST_PRETEND_CUDA=1`` makes this test process (only it: not the processes the tests start) believe it
has one CUDA device: ``torch.cuda.is_available()`` is True and ``torch.cuda.device_count()`` is 1. Why: on a GPU
machine the local backend picks ``cuda:0`` (``UNIDIST_DEVICE=auto``), so a unit test that builds its model and
batches on the CPU without saying so fails there and only there. Pretending finds such tests on a CPU machine:
any of them that lets unidist (or DeepSpeed's accelerator detection) choose the device now gets ``cuda:0`` and
fails with "Torch not compiled with CUDA enabled". Every unit test states the device it means instead
(``UNIDIST_DEVICE=cpu``, ``Config(device="cpu")``, ``DS_ACCELERATOR=cpu``), and tests/unit/test_device_explicit.py
runs the unit suite this way. torch is imported only then, so that the tests still see ``import unidist`` light.
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


PRETEND_CUDA = "UNIDIST_TEST_PRETEND_CUDA"


def _pretend_cuda() -> None:
    """One CUDA device, as far as torch's two questions go (see the module's docstring for why)."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1


if os.environ.get(PRETEND_CUDA) == "1":
    _pretend_cuda()


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
