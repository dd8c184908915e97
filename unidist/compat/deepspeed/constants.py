"""``deepspeed.constants``: the names scripts read from it (ds/constants.py)."""

from __future__ import annotations

from unidist.compat.deepspeed.dist import TORCH_DISTRIBUTED_DEFAULT_PORT
from unidist.compat.deepspeed.missing import uncovered

__all__ = ["CROSS_RANK", "CROSS_SIZE", "TORCH_DISTRIBUTED_DEFAULT_PORT"]

CROSS_RANK = "CROSS_RANK"  # the environment variables DeepSpeed's MPI discovery reads (the node's index, the nodes)
CROSS_SIZE = "CROSS_SIZE"

__getattr__ = uncovered(__name__)
