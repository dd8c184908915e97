"""unidist's own log lines when ``UNIDIST_LOG_LEVEL`` is set: on stderr, each prefixed with the rank.

Setting the variable is asking to see them, yet the "unidist" logger prints nothing at INFO or DEBUG until the
script configures logging. So while a Manager runs with the variable set, the logger gets one handler of
unidist's own: ``[unidist rank 1/2] INFO MPIManager started: rank 1 of 2 on cpu``. It is not attached when the
script configured logging first (a handler on the "unidist" logger or on the root logger), and it stays quiet
when the script configures it later: then the script's logging decides. The Manager removes it at shutdown.
"""

from __future__ import annotations

import logging
import sys

from unidist.config import Config

__all__ = ["RankHandler", "attach", "detach"]

LOGGER = "unidist"


class RankHandler(logging.Handler):
    """Writes each record to the current ``sys.stderr`` (looked up per record, so a redirected stderr gets it),
    prefixed with ``[unidist rank R/N]``."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(f"[unidist rank {rank}/{size}] %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if _configured(logging.getLogger(LOGGER), self):  # the script configured logging since: it decides
            return
        try:
            stream = sys.stderr
            if stream is not None:
                stream.write(self.format(record) + "\n")
                stream.flush()
        except Exception:  # as logging.StreamHandler: a failing log line must not stop training
            self.handleError(record)


def _configured(logger: logging.Logger, mine: logging.Handler | None = None) -> bool:
    """Whether the script put a handler on the "unidist" logger or the root logger (``mine`` aside)."""
    return any(h is not mine for h in (*logger.handlers, *logging.getLogger().handlers))


def attach(config: Config, rank: int, size: int) -> RankHandler | None:
    """The handler, attached to the "unidist" logger, when ``UNIDIST_LOG_LEVEL`` came from the environment and
    the script has not configured logging; else None. Once per process: a handler of unidist's already there
    (another Manager's, not yet removed) is left alone."""
    logger = logging.getLogger(LOGGER)
    if "log_level" not in config.from_environment:
        return None
    if any(isinstance(h, RankHandler) for h in logger.handlers) or _configured(logger):
        return None
    handler = RankHandler(rank, size)
    logger.addHandler(handler)
    return handler


def detach(handler: RankHandler | None) -> None:
    """Remove what :func:`attach` attached (nothing when it attached nothing)."""
    if handler is not None:
        logging.getLogger(LOGGER).removeHandler(handler)
