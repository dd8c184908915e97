"""Argument checks, desync fingerprints and bounded waits, shared by every collective.

With ``UNIDIST_CHECK_COLLECTIVES`` every rank of a communicator allgathers a fingerprint of the call it is
about to make (sequence number, call, op, dtype, size, root) and compares: a rank that took another code
path is named instead of leaving the others waiting or, worse, reducing mismatched data.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from unidist.comm.dtypes import DTYPE_ID, SUPPORTED_DTYPES
from unidist.comm.work import Work
from unidist.errors import CollectiveMismatchError, CollectiveTimeoutError, InvalidArgumentError
from unidist.ops import ReduceOp

__all__ = ["CALLS", "check_rank", "check_tag", "signature", "wait_bounded"]

CALLS = ("barrier", "broadcast", "allreduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
         "send", "recv")
_CALL_ID = {n: i for i, n in enumerate(CALLS)}
_OP_ID = {op: i for i, op in enumerate(ReduceOp)}


def check_rank(value: object, size: int, what: str = "root") -> int:
    """A rank of a communicator of ``size``; integer-likes (numpy ints, 0-d tensors) are accepted."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what}={value!r} is not an integer rank (0..{size - 1})")
    rank = int(value.__index__())  # type: ignore[attr-defined]
    if not 0 <= rank < size:
        raise InvalidArgumentError(f"{what}={rank} is not a rank of this communicator (0..{size - 1})")
    return rank


def check_tag(tag: int) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < 32768:
        raise InvalidArgumentError(f"tag={tag!r} must be an int in 0..32767 (the smallest upper bound MPI allows)")
    return tag


def signature(comm: Any, call: str, t: torch.Tensor | None, op: ReduceOp | None, root: int,
              numel: int | None) -> None:
    """Every rank of ``comm`` compares what it is about to call; -1 matches anything."""
    comm._seq += 1
    dtype_id = DTYPE_ID.get(t.dtype, -1) if t is not None else -1
    n = numel if numel is not None else (t.numel() if t is not None else -1)
    sig = torch.tensor([comm._seq, _CALL_ID[call], _OP_ID[op] if op else -1, dtype_id, n, root], dtype=torch.int64)
    table = torch.empty(comm._size * sig.numel(), dtype=torch.int64)
    where = f"{call} (collective #{comm._seq})"
    wait_bounded(comm._allgather_async(sig, table, [sig.numel()] * comm._size), comm.config.timeout, comm._rank,
                 where)
    rows = table.view(comm._size, -1).tolist()
    first = rows[0]
    for row in rows[1:]:
        if any(a != b and a != -1 and b != -1 for a, b in zip(row, first, strict=True)):
            calls = "; ".join(f"rank {r} called {_describe(v)}" for r, v in enumerate(rows))
            raise CollectiveMismatchError(
                f"collective #{comm._seq} does not match across ranks: {calls}. Every rank must make the "
                "same collective calls, with matching dtypes, sizes, ops and roots, in the same order."
            )


def wait_bounded(work: Work, timeout: float, rank: int, where: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds, then raise naming the call."""
    deadline = time.monotonic() + timeout
    delay = 1e-5
    while not work.test():
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"rank {rank} waited {timeout:g} s in {where} and not every rank joined: one rank is behind, "
                "stuck or took another code path. Raise UNIDIST_TIMEOUT if the wait is legitimate."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    work.wait()


def _describe(row: Iterable[int]) -> str:
    _, call, op, dtype, numel, root = row
    parts = []
    if op >= 0:
        parts.append(f"op={list(ReduceOp)[op].value}")
    if root >= 0:
        parts.append(f"root={root}")
    if dtype >= 0:
        parts.append(f"dtype={str(SUPPORTED_DTYPES[dtype]).replace('torch.', '')}")
    if numel >= 0:
        parts.append(f"numel={numel}")
    return f"{CALLS[call]}({', '.join(parts)})"
