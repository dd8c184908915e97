"""LocalManager: a world of one process, so every script also runs as plain ``python script.py``."""

from __future__ import annotations

from unidist.comm.engine import Engine, SoloEngine
from unidist.errors import LaunchEnvironmentError
from unidist.managers.base import Manager

__all__ = ["LocalManager"]


class LocalManager(Manager):
    """Every collective is the identity on one rank (a SoloEngine); send/recv to self goes through a mailbox."""

    name = "local"

    def _start(self) -> Engine:
        if self.launch.size > 1:
            raise LaunchEnvironmentError(
                f"LocalManager runs one process, but the {self.launch.launcher} launcher started "
                f"{self.launch.size}; unset UNIDIST_BACKEND=local or pick a multi-process backend"
            )
        self._local_rank, self._local_size, self._node_rank = 0, 1, 0
        return SoloEngine()

    def _shutdown(self) -> None:
        self._engine.close()
