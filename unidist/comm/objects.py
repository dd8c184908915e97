"""Collectives of picklable Python objects, moved as bytes through a communicator's tensor primitives. Peers
are trusted: what they send is unpickled (README, "Security")."""

from __future__ import annotations

from typing import Any

import torch

from unidist.comm.dtypes import from_bytes, to_bytes

__all__ = ["ObjectCollectives"]

_INT64 = torch.int64


class ObjectCollectives:
    """``broadcast_object`` and ``allgather_object`` for Collectives."""

    _rank: int
    _check_root: Any
    _signature: Any
    _broadcast: Any
    _allgather_rows: Any

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Root's picklable object on every rank (root gets its own object back)."""
        root = self._check_root(root)
        self._signature("broadcast", root=root)
        if self._rank == root:
            payload = to_bytes(obj)
            length = torch.tensor([payload.numel()], dtype=_INT64)
        else:
            length = torch.zeros(1, dtype=_INT64)
        self._broadcast(length, root)
        if self._rank != root:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(payload, root)
        return obj if self._rank == root else from_bytes(payload.numpy())

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, as a list indexed by rank."""
        out, rows = self._allgather_rows("allgather", to_bytes(obj))
        data, objs, start = out.numpy(), [], 0
        for n in rows:
            objs.append(from_bytes(data[start:start + n]))
            start += n
        return objs
