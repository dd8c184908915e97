"""The loader ``initialize(training_data=...)`` returns: DeepSpeed's ``DeepSpeedDataLoader`` order on any backend.

DeepSpeed 0.19.8 (``runtime/dataloader.py``) batches each rank's share with the micro-batch size, drawn by torch's
``DistributedSampler(dataset, num_replicas=world, rank=rank)`` with its defaults (shuffled, seed 0, padded by
wrapping around) and never calls ``set_epoch``: every epoch repeats the first one's order. unidist's
``ShardSampler`` yields the same indices without a process group; the loader keeps DeepSpeed's quirk (no
reshuffle) so the same script sees the same batches. ``num_workers`` is 0 here (DeepSpeed's 2 worker processes
change no sample, only speed), and ``pin_memory`` only where the Manager's device is a GPU (as ``mgr.loader``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from unidist.errors import InvalidArgumentError

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]


class DeepSpeedDataLoader:
    """Iterates this rank's micro-batches of ``dataset`` (``len()`` is the number of batches)."""

    def __init__(self, mgr: Any, dataset: Any, batch_size: int, collate_fn: Any = None,
                 drop_last: bool = False) -> None:
        if not isinstance(dataset, Dataset) or isinstance(dataset, IterableDataset):
            raise InvalidArgumentError("Training data must be a torch Dataset (a map-style torch.utils.data.Dataset "
                                       f"with __len__), got {type(dataset).__name__}")
        self.data_sampler = mgr.shard(dataset, shuffle=True, seed=0, drop_last=False)  # DistributedSampler's defaults
        self.batch_size = batch_size
        self._loader = DataLoader(dataset, batch_size=batch_size, sampler=self.data_sampler, collate_fn=collate_fn,
                                  drop_last=drop_last, num_workers=0, pin_memory=mgr.device.type == "cuda")

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def __len__(self) -> int:
        return len(self._loader)


class RepeatingLoader:
    """``deepspeed.utils.RepeatingLoader``: iterates ``loader`` forever, starting it again when it ends.

    Args:
        loader: any iterable (a DataLoader, the loader ``initialize`` returned).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
