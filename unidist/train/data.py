"""``mgr.loader(dataset, ...)``: this rank's DataLoader, its batches already on the rank's device.

What Accelerate's ``prepare(dataloader)`` and Fabric's ``setup_dataloaders`` give their users, on every backend:
the rank's disjoint share of the dataset (``ShardSampler``: the same permutation on every rank, a new one each
epoch), pinned CPU memory when the device is a GPU, and each batch moved there (``unidist.tree.to_device``:
dicts, tuples, dataclasses and ``ModelOutput``-like batches keep their type). Iterating again starts the next epoch;
``set_epoch`` sets it (a resumed run).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch

from unidist.errors import InvalidArgumentError
from unidist.train.sampler import ShardSampler
from unidist.tree import to_device

__all__ = ["Loader"]

# DataLoader arguments the loader sets itself: passing them would undo the sharding
_OWN = ("sampler", "batch_sampler", "shuffle")


class Loader:
    """A ``torch.utils.data.DataLoader`` over this rank's share of ``dataset``, yielding batches on ``device``.

    Args:
        dataset: any map-style dataset (with ``__len__`` and ``__getitem__``).
        rank: this rank's place among ``size`` data-parallel ranks.
        size: how many ranks share the dataset.
        device: where each batch is moved.
        batch_size: the rows of one batch on this rank.
        shuffle: a new permutation every epoch (the same on every rank); False keeps the dataset's order.
        seed: the permutation's seed (with the epoch).
        drop_last: drop the tail that does not divide evenly among the ranks and a last incomplete batch;
            False wraps around so every rank gets as many rows (torch's DistributedSampler does the same).
        kwargs: any other ``DataLoader`` argument (``num_workers``, ``collate_fn``, ``pin_memory``...).
    """

    def __init__(self, dataset: Sized, *, rank: int, size: int, device: torch.device, batch_size: int = 1,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, **kwargs: Any) -> None:
        given = [k for k in _OWN if k in kwargs]
        if given:
            raise InvalidArgumentError(f"loader() got {', '.join(given)}: it shards the dataset itself (each rank "
                                       "its share, reshuffled per epoch with shuffle=True); pass shuffle= and seed=, "
                                       "or build your own DataLoader with mgr.shard(dataset) as its sampler")
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise InvalidArgumentError(f"loader() takes a map-style dataset (len() and [i]), got "
                                       f"{type(dataset).__name__}; an IterableDataset shards itself: build its "
                                       "DataLoader directly")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(f"loader(batch_size={batch_size!r}) must be an int >= 1")
        kwargs.setdefault("pin_memory", device.type == "cuda")
        self.device = device
        self.sampler = ShardSampler(dataset, rank, size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, sampler=self.sampler, drop_last=drop_last, **kwargs)  # type: ignore[arg-type]
        self._next_epoch = 0

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs."""
        return self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its permutation; a resumed run continues the order)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidArgumentError(f"set_epoch({epoch!r}) takes an int >= 0")
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self._next_epoch)
        self._next_epoch += 1
        for batch in self.loader:
            yield to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.loader)

    def __repr__(self) -> str:
        return (f"Loader({type(self.dataset).__name__}, rank {self.sampler.rank} of {self.sampler.size}, "
                f"{len(self)} batches of {self.batch_size}, on {self.device})")

