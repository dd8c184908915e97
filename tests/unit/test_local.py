"""LocalManager: the whole collective suite on one process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from workers.collectives import plan

import unidist
from unidist import Config, LaunchInfo

CASES = dict(plan(1))
# The suite's torch inputs are CPU tensors (tests/workers/collectives.py DEVICE), and prepare() moves a model to
# the Manager's device: the Manager is told the CPU, so that a GPU machine runs the same suite. The topology case
# checks the device rule itself (cuda:N where torch sees a GPU, else the CPU: UNIDIST_DEVICE unset, as a launched
# worker has it), so it runs on a Manager left to choose.
ON_CPU = {"UNIDIST_DEVICE": "cpu"}
UNSET: dict[str, str] = {}
ENVIRON = {case: UNSET if case == "topology" else ON_CPU for case in CASES}


@pytest.fixture(scope="module")
def mgr(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One Manager for the module (the suite has hundreds of cases); a test may name its environment (indirect
    parametrization): pytest then ends one such Manager before it starts the next, as only one may be active."""
    with unidist.init(environ=getattr(request, "param", ON_CPU)) as m:
        yield m


@pytest.mark.parametrize(("mgr", "case"), [pytest.param(ENVIRON[c], c, id=c) for c in CASES], indirect=["mgr"])
def test_suite(mgr: Any, case: str) -> None:
    CASES[case](mgr)


def test_env_is_restored(mgr: Any) -> None:
    import os

    os.environ.pop("UNIDIST_TEST_VAR", None)
    m = unidist.LocalManager(Config(device="cpu"), LaunchInfo())
    m._setenv("UNIDIST_TEST_VAR", "1")
    assert os.environ["UNIDIST_TEST_VAR"] == "1"
    m._restore_env()
    assert "UNIDIST_TEST_VAR" not in os.environ


def test_requires_grad_input(mgr: Any) -> None:
    p = torch.ones(3, requires_grad=True)
    out = mgr.allreduce(p * 2)
    assert not out.requires_grad
    assert out.tolist() == [2.0, 2.0, 2.0]
    mgr.allreduce_(p)  # in place on a leaf works (on its data)


def test_send_recv_self(mgr: Any) -> None:
    mgr.send(torch.arange(3), dest=0, tag=1)
    buf = torch.zeros(3, dtype=torch.int64)
    assert mgr.recv(buf, source=0, tag=1).tolist() == [0, 1, 2]
    with pytest.raises(unidist.InvalidArgumentError, match="wait forever"):
        mgr.recv(buf, source=0, tag=1)
