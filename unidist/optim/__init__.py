"""Training helpers written once on the Manager's collectives (used by the local, MPI and torch backends)."""

from unidist.optim.distributed import DistributedOptimizer
from unidist.optim.sampler import ShardSampler

__all__ = ["DistributedOptimizer", "ShardSampler"]
