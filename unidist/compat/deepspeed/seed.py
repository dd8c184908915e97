"""DeepSpeed's ``set_random_seed`` (``deepspeed.runtime.utils``), kept here so ``pipe`` (seed_layers) and
``runtime.utils`` both import it without importing each other."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy and torch with ``seed``, as DeepSpeed's (runtime/utils.py): numpy's modulo
    2**32 and torch's modulo 2**63, the widths they accept.

    Args:
        seed: the seed.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
