"""Groups on the local backend (a world of one): construction, validation, one-rank collectives, lifetime.

Multi-rank groups run under the real launchers in tests/multiproc/test_group_suite.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import unidist
from unidist import InvalidArgumentError, NotInitializedError
from unidist.comm.engine import SoloEngine, SortedOrder


@pytest.fixture
def mgr() -> unidist.Manager:
    with unidist.init(environ={}) as m:
        yield m


@pytest.mark.parametrize("ranks", [[0], (0,), range(1), np.array([0]), torch.tensor([0]), [np.int64(0)]])
def test_new_group_accepts_rank_lists(mgr: unidist.Manager, ranks: object) -> None:
    g = mgr.new_group(ranks)  # type: ignore[arg-type]
    assert isinstance(g.engine, SoloEngine)
    assert (g.rank, g.size, g.ranks) == (0, 1, (0,))


@pytest.mark.parametrize(("ranks", "words"), [
    ([], "names no rank"), ([1], "not a world rank (0..0)"), ([-1], "not a world rank"), ([0, 0], "twice"),
    ("0", "list of world ranks"), ({0}, "in group order"), ([True], "not a world rank"), ([0.0], "not a world rank"),
    (0, "list of world ranks"),
])
def test_new_group_refuses_bad_lists(mgr: unidist.Manager, ranks: object, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match="new_group") as info:
        mgr.new_group(ranks)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_split(mgr: unidist.Manager) -> None:
    g = mgr.split(7, key=-3)
    assert g is not None and (g.rank, g.size, g.ranks) == (0, 1, (0,))
    assert mgr.split(None) is None
    assert mgr.split(np.int32(1)) is not None
    for bad in ("a", 1.5, True):
        with pytest.raises(InvalidArgumentError, match="split"):
            mgr.split(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="key"):
        mgr.split(0, key="first")  # type: ignore[arg-type]


def test_one_rank_group_collectives(mgr: unidist.Manager) -> None:
    g = mgr.new_group([0])
    assert g is not None
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(g.allreduce(x, "max"), x) and torch.equal(g.allgather(x), x)
    assert torch.equal(g.reduce_scatter(x), x) and torch.equal(g.alltoall(x), x)
    assert np.array_equal(g.broadcast(np.ones(2)), np.ones(2))
    assert g.allgather_object("a") == ["a"]
    g.send(x, dest=0, tag=5)
    got = torch.empty(3, 2)
    g.recv(got, source=0, tag=5)
    assert torch.equal(got, x)
    with pytest.raises(InvalidArgumentError, match="would wait forever"):
        g.recv(got, source=0, tag=6)
    with pytest.raises(InvalidArgumentError, match="root"):
        g.broadcast(x, root=1)  # a group rank, and this group has one


def test_group_dies_with_its_manager() -> None:
    with unidist.init(environ={}) as m:
        g = m.split(0)
    assert g is not None
    with pytest.raises(NotInitializedError, match="shut down"):
        g.allreduce(torch.ones(1))


def test_sorted_order_permutes_chunks() -> None:
    """An engine that orders members by world rank: group [3, 1, 2] is engine order [1, 2, 3]."""
    order = SortedOrder()
    order._set_order([3, 1, 2])
    assert order._perm == (1, 2, 0)
    counts = [1, 2, 3]  # group ranks 0, 1, 2 (world 3, 1, 2)
    group_flat = torch.tensor([0.0, 1, 1, 2, 2, 2])
    engine = order._to_engine_order(group_flat, counts)
    assert engine.tolist() == [1, 1, 2, 2, 2, 0]  # world 1, world 2, world 3
    assert order._permuted(counts) == [2, 3, 1]
    assert torch.equal(order._from_engine_order(engine, counts), group_flat)
    order._set_order([1, 2, 3])
    assert order._perm is None and order._to_engine_order(group_flat, counts) is group_flat
