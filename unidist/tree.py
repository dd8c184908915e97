"""The tensors inside whatever a model takes or returns, and the same structure rebuilt around new ones.

Models return more than tensors and tuples: Hugging Face's ``ModelOutput`` (a dataclass that is also an ordered
dict), namedtuples, plain and frozen dataclasses, nested lists and dicts. Whatever unidist does to a forward's
outputs (precision casts, ZeRO-3's backward hooks) or to a batch must hand back the *same type*: a user who
reads ``out.loss`` must still be able to. One walk, used everywhere, so every caller agrees on what a
container is:

- a tensor is a leaf;
- a ``Mapping`` (dict, OrderedDict, defaultdict, ``ModelOutput``) is shallow-copied (``copy.copy``, which keeps
  its type, its ``default_factory`` and a ``ModelOutput``'s attributes) and its changed values set again;
- a namedtuple is rebuilt from its fields, any other tuple or list by its type from the new items;
- a dataclass instance (frozen ones too) is shallow-copied and its changed fields set with
  ``object.__setattr__`` (no ``__init__`` or ``__post_init__`` runs again);
- anything else (and a container whose type cannot be rebuilt this way) is returned unchanged, tensors inside
  it included: unidist cannot see into an arbitrary object.

Nothing is copied when no tensor changed: the input itself comes back.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import torch

__all__ = ["map_tensors", "tensors", "to_device"]

T = TypeVar("T")


def map_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``data`` with every tensor ``t`` inside it replaced by ``fn(t)``, each container keeping its type (see the
    module docstring for what counts as one and what is returned unchanged).

    Args:
        data: a tensor, a (nested) container of tensors, or anything else.
        fn: applied to each tensor found; returning its argument leaves it in place.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (str, bytes, int, float, bool)) or data is None:
        return data
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, fn)
    if isinstance(data, (list, tuple)):
        items = [map_tensors(d, fn) for d in data]
        if all(a is b for a, b in zip(items, data, strict=True)):
            return data
        return _rebuild_sequence(data, items)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return _rebuild_dataclass(data, fn)
    return data


def tensors(data: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``data``, in order, found by the same walk as :func:`map_tensors`."""
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, Mapping):
        for v in data.values():
            yield from tensors(v)
    elif isinstance(data, (list, tuple)):
        for d in data:
            yield from tensors(d)
    elif dataclasses.is_dataclass(data) and not isinstance(data, type):
        for f in dataclasses.fields(data):
            yield from tensors(getattr(data, f.name, None))


def _rebuild_mapping(data: Mapping[Any, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    changed = {}
    for k, v in data.items():
        new = map_tensors(v, fn)
        if new is not v:
            changed[k] = new
    if not changed:
        return data
    if type(data) is dict:
        return {**data, **changed}
    try:
        out = copy.copy(data)
        for k, v in changed.items():
            out[k] = v  # type: ignore[index]  # a read-only Mapping raises: returned unchanged below
    except Exception:  # a mapping that cannot be copied or assigned to: unidist cannot rebuild it
        return data
    return out


def _rebuild_sequence(data: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    kind = type(data)
    if kind is list or kind is tuple:
        return kind(items)
    try:
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple: its fields are positional
            return kind(*items)
        return kind(items)
    except Exception:  # a subclass whose constructor takes something else
        return data


def _rebuild_dataclass(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    changed = {}
    for f in dataclasses.fields(data):
        if not hasattr(data, f.name):
            continue
        value = getattr(data, f.name)
        new = map_tensors(value, fn)
        if new is not value:
            changed[f.name] = new
    if not changed:
        return data
    try:
        out = copy.copy(data)
        for name, value in changed.items():
            object.__setattr__(out, name, value)  # frozen dataclasses too
    except Exception:  # slots without a copy protocol, or a custom __setattr__ that refuses
        return data
    return out


def to_device(data: T, device: torch.device, non_blocking: bool | None = None) -> T:
    """``data`` with every tensor on ``device``, each container keeping its type (``map_tensors``); tensors already
    there are left as they are.

    Args:
        data: a tensor or any nesting of the containers ``map_tensors`` knows (a DataLoader's batch).
        device: where the tensors go.
        non_blocking: copy asynchronously; by default only from pinned host memory to a GPU, where torch makes
            that safe (the copy is ordered on the current stream before any use of the result).
    """
    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        quick = non_blocking if non_blocking is not None else (device.type == "cuda" and t.is_pinned())
        return t.to(device, non_blocking=quick)
    return cast(T, map_tensors(data, move))  # the same structure, its tensors moved

