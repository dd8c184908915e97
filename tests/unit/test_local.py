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


@pytest.fixture(scope="module")
def mgr() -> Iterator[Any]:
    with unidist.init(environ={}) as m:
        yield m


@pytest.mark.parametrize("case", CASES)
def test_suite(mgr: Any, case: str) -> None:
    CASES[case](mgr)


def test_env_is_restored(mgr: Any) -> None:
    import os

    os.environ.pop("UNIDIST_TEST_VAR", None)
    m = unidist.LocalManager(Config(), LaunchInfo())
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
