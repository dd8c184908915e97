"""A real Slurm for the module (``slurmcluster.SlurmCluster``), started once per session and stopped after.

Where Slurm is not installed or this is not root the tests skip and say why, unless REQUIRE_SLURM=1 (tox sets
it, and CI installs the packages with .ci/install_slurm.sh) turns that into a failure.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurmcluster import SlurmCluster, missing


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    reason = missing()
    if reason:
        if os.environ.get("REQUIRE_SLURM") == "1":
            pytest.fail(f"{reason}, but REQUIRE_SLURM=1 requires a real Slurm")
        pytest.skip(reason)
    cluster = SlurmCluster()
    try:
        cluster.start()
    except RuntimeError as err:
        cluster.stop()
        pytest.fail(f"Slurm would not start: {err}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)  # failures quote the logs they need
