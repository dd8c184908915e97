"""Stub: DistributedOptimizer."""

from __future__ import annotations

from typing import Any


def DistributedOptimizer(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
