"""Stub: Horovod's collectives and handles (helper A)."""

from __future__ import annotations

from typing import Any


def allgather(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def allgather_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def allreduce(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def allreduce_(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def allreduce_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def allreduce_async_(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def alltoall(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def alltoall_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def barrier(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def broadcast(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def broadcast_(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def broadcast_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def broadcast_async_(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_allgather(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_allgather_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_allreduce(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_allreduce_(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_allreduce_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_allreduce_async_(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_reducescatter(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def grouped_reducescatter_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def join(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def poll(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def reducescatter(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def reducescatter_async(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def synchronize(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
