"""Stub: Horovod's Adasum delta optimizer (helper B)."""

from __future__ import annotations

from typing import Any


def adasum_optimizer(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
