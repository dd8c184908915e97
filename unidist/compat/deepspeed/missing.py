"""What a DeepSpeed name the compat layer lacks says, in every package of the layer: one wording, one page.

``uncovered(__name__)`` is a package's module ``__getattr__`` (``deepspeed.runtime.config`` is an AttributeError
naming the way out); ``refuse_imports()`` does the same for an ``import`` of a module the layer lacks
(``deepspeed.ops.sparse_attention``). The names scripts use and what each does here are ``names.py``'s table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from unidist.compat import not_covered, refuse_missing_modules

__all__ = ["INSTEAD", "PAGE", "refuse_imports", "uncovered"]

ROOT = "unidist.compat.deepspeed"
PAGE = "docs/coming-from/deepspeed.md (its table of DeepSpeed names)"
INSTEAD = "Import deepspeed itself for it (its own launcher runs it), or leave the call out."


def _theirs(package: str) -> str:
    return "deepspeed" + package[len(ROOT):]


def uncovered(package: str) -> Callable[[str], NoReturn]:
    """The module ``__getattr__`` of ``package`` (a module of this layer)."""
    return not_covered(package, _theirs(package), PAGE, INSTEAD)


def refuse_imports() -> None:
    """An import of a module this layer lacks raises ModuleNotFoundError with the way out."""
    refuse_missing_modules(ROOT, "deepspeed", PAGE, INSTEAD)
