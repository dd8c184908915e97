"""Stub: hvd.elastic (helper C)."""

from __future__ import annotations

from typing import Any


def run(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


class TorchState:
    pass


class ObjectState:
    pass


class State:
    pass
