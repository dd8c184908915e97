"""``mgr.loader(dataset, ...)``: this rank's DataLoader, its batches already on the rank's device.

What Accelerate's ``prepare(dataloader)`` and Fabric's ``setup_dataloaders`` give their users, on every backend:
the rank's disjoint share of the dataset (``ShardSampler``: the same permutation on every rank, a new one each
epoch), pinned CPU memory when the device is a GPU, and each batch moved there (``unidist.tree.to_device``:
dicts, tuples, dataclasses and ``ModelOutput``-like batches keep their type). Iterating again starts the next epoch;
``set_epoch`` sets it (a resumed run); ``state_dict``/``load_state_dict`` (``save_checkpoint(..., loader=)``) keep
the position inside an epoch too, so a run resumed mid-epoch goes on at the next batch.
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
        self._resume: tuple[int, int] | None = None  # (epoch, entries of its order consumed) for the next iteration
        self._running: list[int] | None = None  # [epoch, start, batches yielded] while an epoch is iterated

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

    def state_dict(self) -> dict[str, int]:
        """Where the data stands: the epoch and how many entries of its order the ranks have consumed together
        (batches yielded x batch size x ranks); 0 between epochs. ``save_checkpoint(..., loader=)`` keeps it."""
        if self._running is not None:
            epoch, start, taken = self._running
            done = start + taken * (self.batch_size or 1) * self.sampler.size
            if done < self.sampler.n:
                return {"epoch": epoch, "samples": done}
            return {"epoch": epoch + 1, "samples": 0}
        if self._resume is not None and self._resume[0] == self._next_epoch:  # loaded, not iterated yet
            return {"epoch": self._resume[0], "samples": self._resume[1]}
        return {"epoch": self._next_epoch, "samples": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration continues ``state``'s epoch after the entries consumed, at this loader's number of
        ranks (each remaining entry once), then epochs go on as usual."""
        epoch, samples = state.get("epoch"), state.get("samples")
        if not (isinstance(epoch, int) and isinstance(samples, int) and epoch >= 0 and 0 <= samples <= self.sampler.n):
            raise InvalidArgumentError(f"Loader.load_state_dict({state!r}): not a loader position of this dataset "
                                       f"({self.sampler.n} entries): pass what state_dict() returned")
        self._next_epoch = epoch
        self._resume = (epoch, samples) if samples else None

    def __iter__(self) -> Iterator[Any]:
        epoch = self._next_epoch
        self.sampler.set_epoch(epoch)
        start = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
        self._resume = None
        self.sampler.begin_at(start)
        self._next_epoch += 1
        self._running = running = [epoch, start, 0]
        if start:  # resumed mid-epoch: the run that saved drew the iterator's seed from torch's generator at the
            # epoch's start, before the saved state; drawing it again here would shift every later random op
            kept = torch.get_rng_state()
            batches = iter(self.loader)
            torch.set_rng_state(kept)
        else:
            batches = iter(self.loader)
        for batch in batches:
            running[2] += 1
            yield to_device(batch, self.device)
        if self._running is running:
            self._running = None

    def __len__(self) -> int:
        return len(self.loader)

    def __repr__(self) -> str:
        return (f"Loader({type(self.dataset).__name__}, rank {self.sampler.rank} of {self.sampler.size}, "
                f"{len(self)} batches of {self.batch_size}, on {self.device})")

