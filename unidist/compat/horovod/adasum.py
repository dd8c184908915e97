"""Stub: the Adasum reduction (helper B)."""

from __future__ import annotations

from typing import Any


def adasum_(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
