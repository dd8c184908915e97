"""Each rank's disjoint share of a data set, reshuffled per epoch the same way on every rank."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch

from unidist.errors import InvalidArgumentError

__all__ = ["ShardSampler"]


class ShardSampler(torch.utils.data.Sampler[int]):
    """Like torch's DistributedSampler, without needing a process group: rank ``rank`` of ``size`` gets
    indices ``rank, rank + size, ...`` of a permutation seeded by (seed, epoch). Without ``drop_last`` the
    permutation is padded by wrapping around so every rank gets the same count (no rank waits on a
    missing batch); with it the tail is dropped."""

    def __init__(self, data: Sized | int, rank: int, size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        n = data if isinstance(data, int) else len(data)
        if n < 0 or size < 1 or not 0 <= rank < size:
            raise InvalidArgumentError(f"ShardSampler needs len >= 0 and 0 <= rank < size, got {n}, {rank}, {size}")
        self.n, self.rank, self.size = n, rank, size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.start = 0  # entries of this epoch's order already consumed (a run resumed mid-epoch)
        self.per_rank = self._share(n)

    def _share(self, rest: int) -> int:
        return rest // self.size if self.drop_last else -(-rest // self.size)

    def set_epoch(self, epoch: int) -> None:
        """Call at the start of every epoch so each gets a new order (the same on every rank)."""
        self.epoch = epoch

    def begin_at(self, start: int) -> None:
        """This epoch's order without its first ``start`` entries, spread over the ranks: what a run stopped
        mid-epoch had not yet consumed (at any number of ranks: the consumed entries are the order's first ones,
        ranks taking them in turn). 0: the whole epoch."""
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= self.n:
            raise InvalidArgumentError(f"ShardSampler.begin_at({start!r}) takes an int in [0, {self.n}]")
        self.start = start
        self.per_rank = self._share(self.n - start)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.n))
        order = order[self.start:]
        total = self.per_rank * self.size
        if total > len(order) and order:
            order += (order * (total // len(order) + 1))[: total - len(order)]
        return iter(order[self.rank:total:self.size])

    def __len__(self) -> int:
        return self.per_rank
