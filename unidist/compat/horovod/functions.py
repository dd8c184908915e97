"""Stub: parameter, optimizer-state and object broadcasts."""

from __future__ import annotations

from typing import Any


def allgather_object(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def broadcast_object(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def broadcast_optimizer_state(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def broadcast_parameters(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
