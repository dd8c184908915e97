"""The simulated cluster as a fixture: ``cluster2`` (h1, h2) for a whole module, torn down even on failure.

Where the machine cannot build one (not root, no ``ip``/``unshare``/``nsenter``) the tests skip and say why,
unless REQUIRE_CLUSTER=1 (CI) turns that into a failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakehosts import Cluster, sweep, why_unavailable


def _cluster(n: int, names: tuple[str, ...] | None = None) -> Iterator[Cluster]:
    reason = why_unavailable()
    if reason:
        if os.environ.get("REQUIRE_CLUSTER") == "1":
            pytest.fail(f"{reason}, but REQUIRE_CLUSTER=1 requires the simulated cluster")
        pytest.skip(reason)
    sweep()
    with Cluster(n, names=names) as cluster:
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
