"""Stub: init, topology and the build queries (helper A)."""

from __future__ import annotations

from typing import Any


def ccl_built(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def cross_rank(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def cross_size(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def cuda_built(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def ddl_built(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def gloo_built(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def gloo_enabled(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def init(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def is_homogeneous(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def is_initialized(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def local_rank(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def local_size(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def mpi_built(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def mpi_enabled(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def mpi_threads_supported(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def nccl_built(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def rank(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def rocm_built(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def shutdown(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def size(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def start_timeline(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def stop_timeline(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


def manager(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
