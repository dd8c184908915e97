"""What a checkpoint carries for the run besides the model and optimizer: every rank's random generators
(rng.py) and, with ``save_checkpoint(..., loader=)``, a loader's position (data.py), each under its own key of
the checkpoint's ``extra``; ``restore`` takes them out again before ``extra`` reaches the user."""

from __future__ import annotations

import logging
import os
from typing import Any

from unidist.checkpoint.agree import World
from unidist.errors import CheckpointError, InvalidArgumentError
from unidist.train import rng
from unidist.train.data import Loader

__all__ = ["LOADER_KEY", "carried", "check_loader", "restore"]

_log = logging.getLogger("unidist")
LOADER_KEY = "unidist.loader"  # a loader's position: {"epoch", "samples"}


def check_loader(loader: Any, call: str) -> Loader:
    """``loader`` if ``mgr.loader`` made it (its position can be kept), else an InvalidArgumentError."""
    if not isinstance(loader, Loader):
        raise InvalidArgumentError(f"{call}(loader=...) takes a loader from mgr.loader(...), got "
                                   f"{type(loader).__name__}; for your own DataLoader save the epoch in extra and "
                                   "skip the batches already seen")
    return loader


def carried(world: World, loader: Any = None) -> dict[str, Any]:
    """The entries to add to a checkpoint's ``extra`` (collective: every rank's generators go to every rank)."""
    out: dict[str, Any] = {rng.KEY: world.allgather_object(rng.capture())}
    if loader is not None:
        out[LOADER_KEY] = check_loader(loader, "save_checkpoint").state_dict()
    return out


def restore(world: World, extra: dict[str, Any], loader: Any, path: str | os.PathLike[str]) -> None:
    """Take the run's entries out of a loaded ``extra``: this rank's generators back (a checkpoint written before
    they were kept has none), ``loader`` put where the saved one was."""
    states = extra.pop(rng.KEY, None)
    if states is not None:
        said = rng.restore(states, world.rank, world.size)
        if said is not None:
            _log.warning(said)
    position = extra.pop(LOADER_KEY, None)
    if loader is None:
        return
    if position is None:
        raise CheckpointError(f"load_checkpoint({str(path)!r}, loader=...): the checkpoint has no loader position "
                              "(it was saved without save_checkpoint(..., loader=)); load without loader= and set "
                              "its epoch with loader.set_epoch(...)")
    check_loader(loader, "load_checkpoint").load_state_dict(position)
