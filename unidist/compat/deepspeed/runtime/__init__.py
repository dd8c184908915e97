"""``deepspeed.runtime``: the packages scripts reach through it (``engine.DeepSpeedEngine`` for ``isinstance``
checks, ``utils.set_random_seed``, ``dataloader.RepeatingLoader``, ``zero.GatheredParameters``, ``pipe.engine``),
each mapping with only the import line changed; a name it lacks says so (missing.py)."""

from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.runtime import dataloader, engine, pipe, utils, zero

__all__ = ["dataloader", "engine", "pipe", "utils", "zero"]

__getattr__ = uncovered(__name__)
