"""``hvd.elastic.ElasticSampler``: Horovod's sampler that resumes an epoch where the last commit left it.

Horovod 0.28's semantics: the epoch's order is one seeded shuffle of the whole dataset, the same on every
rank; ``record_batch`` counts the samples the whole world has processed (``batch_size * size`` per batch),
and ``reset`` (called by ``set_epoch``, ``load_state_dict`` and on a restart) drops that many from the front
of the order and deals the rest out round-robin to the ranks now in the job. So a job restarted from a commit
mid-epoch, at the same or another world size, processes each of the epoch's remaining samples exactly once.
Older Horovod's ``record_indices``/``get_indices`` are kept too: indices recorded that way are dropped
wherever they are in the order (the union over ranks is taken when the state syncs).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch.utils.data

import unidist
from unidist.errors import InvalidArgumentError

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Partitions ``dataset`` over the ranks and repartitions what is left of the epoch after a restart.

    Args:
        dataset: anything with ``len()`` (assumed constant).
        shuffle: shuffle the order each epoch (seeded by ``seed + epoch``, the same on every rank).
        seed: the shuffle's seed; must be the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        if not hasattr(dataset, "__len__"):
            raise InvalidArgumentError(
                f"ElasticSampler(dataset=...) needs a dataset with len(), got {type(dataset).__name__}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order, nothing processed. Call it at the *end* of an epoch (as Horovod
        says), so that a restart in the middle of one does not reprocess its first part."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that every rank processed one more batch of ``batch_size`` samples (``batch_idx`` is not used,
        as in Horovod 0.28)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record these dataset indices as processed (older Horovod's form; unioned over ranks on sync)."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch ``batch_idx`` of the current pass (after ``iter``)."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        """What a commit saves: the epoch and how much of it is done (sorted lists, so it pickles the same)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a ``state_dict()`` (Horovod 0.28's two keys are enough)."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict.get("processed_num", 0))
        self.processed_indices = {int(i) for i in state_dict.get("processed_indices", ())}
        self.reset()

    def reset(self) -> None:
        """Re-deal what is left of the epoch over the ranks of the running job."""
        mgr = unidist.get_manager()
        self.num_replicas, self.rank = mgr.size, mgr.rank
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        rest = order[self.processed_num:]
        if self.processed_indices:
            rest = [i for i in rest if i not in self.processed_indices]
        self.remaining_indices = rest
        self.num_samples = math.ceil(len(rest) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        padded = self.remaining_indices[:]
        padded += padded[:self.total_size - len(padded)]  # evenly divisible, as DistributedSampler pads
        self.indices = padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
