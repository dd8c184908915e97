"""ShardSampler: disjoint, covering, equal shares; reshuffled per epoch; the same order on every rank."""

from __future__ import annotations

import pytest

from unidist import InvalidArgumentError
from unidist.train import ShardSampler


@pytest.mark.parametrize(("n", "size"), [(10, 2), (10, 3), (7, 4), (0, 2), (1, 3), (100, 1)])
def test_shares(n: int, size: int) -> None:
    parts = [list(ShardSampler(n, r, size, seed=3)) for r in range(size)]
    assert len({len(p) for p in parts}) == 1
    assert set().union(*parts) == set(range(n))
    assert all(len(p) == len(ShardSampler(n, r, size)) for r, p in enumerate(parts))
    dropped = [list(ShardSampler(n, r, size, drop_last=True)) for r in range(size)]
    flat = [i for p in dropped for i in p]
    assert len(flat) == len(set(flat)) == (n // size) * size


def test_epochs_reshuffle_and_no_shuffle_is_ordered() -> None:
    s = ShardSampler(50, 0, 2, seed=1)
    a = list(s)
    s.set_epoch(1)
    assert list(s) != a
    assert list(ShardSampler(6, 1, 2, shuffle=False)) == [1, 3, 5]


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        ShardSampler(10, 2, 2)
