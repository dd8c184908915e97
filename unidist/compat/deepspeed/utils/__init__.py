"""``deepspeed.utils``: ``logger`` and ``log_dist`` (logging.py), ``RepeatingLoader``, and the ``safe_get_full_*``
helpers (zero_helpers.py)."""

from __future__ import annotations

from unidist.compat.deepspeed.dataloader import RepeatingLoader
from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.utils import logging
from unidist.compat.deepspeed.utils.logging import log_dist, logger
from unidist.compat.deepspeed.utils.zero_helpers import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
)

__all__ = ["RepeatingLoader", "log_dist", "logger", "logging", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state"]

__getattr__ = uncovered(__name__)
