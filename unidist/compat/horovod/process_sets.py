"""Stub: process sets on unidist groups (helper A)."""

from __future__ import annotations

from typing import Any


def add_process_set(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def remove_process_set(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


class ProcessSet:
    pass


global_process_set = ProcessSet()
