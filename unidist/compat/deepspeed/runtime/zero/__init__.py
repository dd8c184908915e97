"""``deepspeed.runtime.zero``: ``GatheredParameters`` and ``Init``, as ``deepspeed.zero`` has them."""

from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]

__getattr__ = uncovered(__name__)
