"""The simulated cluster as a fixture: ``cluster2`` (h1, h2) for a whole module, torn down even on failure
(``no_pdsh`` and ``real_pdsh``: two hosts without any pdsh, and with Debian's instead of the stand-in).

Where the machine cannot build one (not root, no ``ip``/``unshare``/``nsenter``) the tests skip and say why,
unless REQUIRE_CLUSTER=1 (CI) turns that into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakehosts import Cluster, sweep, why_unavailable


def _cluster(n: int, names: tuple[str, ...] | None = None, pdsh: str = "standin") -> Iterator[Cluster]:
    reason = why_unavailable()
    if reason:
        if os.environ.get("REQUIRE_CLUSTER") == "1":
            pytest.fail(f"{reason}, but REQUIRE_CLUSTER=1 requires the simulated cluster")
        pytest.skip(reason)
    sweep()
    with Cluster(n, names=names, pdsh=pdsh) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster2() -> Iterator[Cluster]:
    yield from _cluster(2)


@pytest.fixture(scope="module")
def cluster3() -> Iterator[Cluster]:
    yield from _cluster(3)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Cluster]:
    """node1 and node2: the host names the README's recipes use."""
    yield from _cluster(2, ("node1", "node2"))


@pytest.fixture(scope="module")
def no_pdsh() -> Iterator[Cluster]:
    """h1 and h2 with no pdsh on either host's PATH: no stand-in, and this machine's own hidden on the hosts."""
    yield from _cluster(2, pdsh="none")


@pytest.fixture(scope="module")
def real_pdsh() -> Iterator[Cluster]:
    """h1 and h2 with this machine's pdsh (Debian's) instead of the stand-in. Where none is installed the tests
    skip saying why, unless REQUIRE_PDSH=1: then .ci/install_pdsh.sh installs it (as root on Debian, as
    .ci/install_slurm.sh installs Slurm) and a pdsh still missing is a failure."""
    script = Path(__file__).resolve().parents[2] / ".ci" / "install_pdsh.sh"
    required = os.environ.get("REQUIRE_PDSH") == "1"
    if shutil.which("pdsh") is None and required:
        subprocess.run(["bash", str(script)], check=False, timeout=600)
    if shutil.which("pdsh") is None:
        reason = "no pdsh on this machine (bash .ci/install_pdsh.sh installs Debian's, as root)"
        if required:
            pytest.fail(f"{reason}, but REQUIRE_PDSH=1 requires the real pdsh")
        pytest.skip(reason)
    yield from _cluster(2, pdsh="system")
