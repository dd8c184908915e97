"""Compatibility layers: the engines' own Python APIs, on every unidist backend.

``import unidist.compat.horovod as hvd`` is ``horovod.torch``'s API. Each layer is written on the layers
below it (the managers' collectives, ``unidist.train``, ``unidist.checkpoint``); nothing below imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NoReturn

__all__ = ["not_covered", "refuse_missing_modules"]


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


class _MissingModules(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: an import of a module under ``package`` that no other finder found (``from
    unidist.compat.deepspeed.ops.sparse_attention import ...``) is a ModuleNotFoundError saying what to do, not
    Python's bare "No module named"."""

    def __init__(self, package: str, engine: str, page: str, instead: str) -> None:
        self.package, self.engine, self.page, self.instead = package, engine, page, instead

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.package + "."):
            return None
        theirs = self.engine + fullname[len(self.package):]
        raise ModuleNotFoundError(f"{theirs} is not in unidist's compatibility layer ({self.package}): it covers "
                                  f"what {self.page} lists. {self.instead}", name=fullname)


def refuse_missing_modules(package: str, engine: str, page: str, instead: str) -> None:
    """Make an import of a module the layer lacks say so and what to do (see ``not_covered``); once per package.

    Args:
        package, engine, page, instead: as ``not_covered``.
    """
    if not any(isinstance(f, _MissingModules) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_MissingModules(package, engine, page, instead))
