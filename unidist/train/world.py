"""What a trainer may ask of the Manager it was made over: the Manager's public, typed accessors, no more.

The trainers (unidist's own, DeepSpeed's, Horovod's) are made by their strategy over a started Manager
(``unidist.strategy.Strategy``); they use it as the world's communicator (:class:`~unidist.comm.protocol.Comm`)
and read a few facts of the run from it. Naming them here keeps the seam narrow and typed: a trainer that needs
something else of its Manager adds it here and as a public accessor there, never by reading a private name.
"""

from __future__ import annotations

from typing import Any, Protocol

from unidist.checkpoint.agree import World
from unidist.comm.protocol import Comm
from unidist.config import Config

__all__ = ["TrainingWorld"]


class TrainingWorld(Comm, World, Protocol):
    """A started Manager, as its trainer sees it: the world's communicator for training (Comm) and for
    checkpoints (World), and the facts below."""

    config: Config

    @property
    def name(self) -> str:
        """Its backend's registry name (``"deepspeed"``): options only one engine understands are checked on it."""
        ...

    @property
    def engine_api(self) -> Any:
        """The engine's own Python API (the ``deepspeed`` module, ``horovod.torch``) for a trainer built on the
        engine; None where the backend has none."""
        ...

    def check_root(self, root: int) -> int:
        """``root`` as a rank of this run, or an InvalidArgumentError naming the valid range."""
        ...
