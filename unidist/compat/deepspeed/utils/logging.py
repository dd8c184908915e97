"""``deepspeed.utils.logging`` (and ``deepspeed.utils``): DeepSpeed's ``logger`` and ``log_dist``.

``logger`` is the logging.Logger named "DeepSpeed" (ds/utils/logging.py:61), so it is the same object real
DeepSpeed logs to when both are imported: level WARNING, not propagating, one stdout handler with DeepSpeed's
format. Real DeepSpeed adds a handler of its own when imported (the deepspeed backend imports it); ours then
stays quiet so no line is printed twice.

``log_dist(message, ranks=None, level=logging.INFO)`` follows ds/utils/logging.py:86-123: before
``init_distributed`` every process logs ``[Rank -1] message``; after it only the ranks in ``ranks`` do
(``[-1]``: every rank; None or []: none), prefixed ``[Rank r]``.
"""

from __future__ import annotations

import logging as _std_logging  # this module is named like the standard one, as DeepSpeed's is
import sys
from collections.abc import Sequence

from unidist.compat.deepspeed.missing import uncovered

__all__ = ["log_dist", "logger"]

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"  # logging.py:40


class _Handler(_std_logging.StreamHandler):  # type: ignore[type-arg]
    """stdout, unless real DeepSpeed has put its own handler on the logger (then that one prints)."""

    def emit(self, record: _std_logging.LogRecord) -> None:
        if any(h is not self and isinstance(h, _std_logging.StreamHandler) for h in logger.handlers):
            return
        super().emit(record)


def _make_logger() -> _std_logging.Logger:
    log = _std_logging.getLogger("DeepSpeed")
    if not log.handlers:  # real DeepSpeed already set it up: keep its level and handler
        log.setLevel(_std_logging.WARNING)
        log.propagate = False
        handler = _Handler(stream=sys.stdout)
        handler.setFormatter(_std_logging.Formatter(_FORMAT))
        log.addHandler(handler)
    return log


logger = _make_logger()


def _dist_message(message: str, ranks: Sequence[int] | None) -> str | None:
    """DeepSpeed's get_dist_msg (_std_logging.py:86-110)."""
    from unidist.compat.deepspeed import comm

    started = comm.is_initialized()
    my_rank = comm.get_rank() if started else -1
    ranks = list(ranks or [])
    should_log = not started or (bool(ranks) and (ranks[0] == -1 or my_rank in set(ranks)))
    return f"[Rank {my_rank}] {message}" if should_log else None


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = _std_logging.INFO) -> None:
    """Log ``message`` on the ranks DeepSpeed would (see the module docstring)."""
    final = _dist_message(message, ranks)
    if final is not None:
        logger.log(level, final)

__getattr__ = uncovered(__name__)
