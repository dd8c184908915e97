"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` (the compat layer's, compat/deepspeed/dataloader.py)."""

from unidist.compat.deepspeed.dataloader import DeepSpeedDataLoader, RepeatingLoader
from unidist.compat.deepspeed.missing import uncovered

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]

__getattr__ = uncovered(__name__)
