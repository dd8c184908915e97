"""Compatibility layers: the engines' own Python APIs, on every unidist backend.

``import unidist.compat.horovod as hvd`` is ``horovod.torch``'s API. Each layer is written on the layers
below it (the managers' collectives, ``unidist.train``, ``unidist.checkpoint``); nothing below imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

__all__ = ["not_covered"]


def not_covered(package: str, engine: str, page: str, instead: str) -> Callable[[str], NoReturn]:
    """A module ``__getattr__`` for a layer's package: a name the engine has and the layer does not is an
    ``AttributeError`` (so ``hasattr`` and ``getattr(..., default)`` still work) that says so and what to do, not
    Python's bare "has no attribute".

    Args:
        package: the layer's module (``unidist.compat.deepspeed``).
        engine: the engine's module as scripts import it (``deepspeed``).
        page: the documentation page listing what the layer covers.
        instead: how to run the script on the engine itself.
    """
    def missing(name: str) -> NoReturn:
        if name.startswith("__"):  # the import system's own probes (__path__, __wrapped__...): the plain answer
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        raise AttributeError(f"{engine}.{name} is not in unidist's compatibility layer ({package}): it covers what "
                             f"{page} lists. {instead}")
    return missing
