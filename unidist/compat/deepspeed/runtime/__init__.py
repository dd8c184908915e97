"""``deepspeed.runtime``: the packages scripts reach through it (``deepspeed.runtime.engine.DeepSpeedEngine`` for
``isinstance`` checks, ``deepspeed.runtime.utils.set_random_seed``), each mapping with only the import line changed."""

from unidist.compat.deepspeed.runtime import engine, utils

__all__ = ["engine", "utils"]
