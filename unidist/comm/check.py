"""Argument checks, desync fingerprints and bounded waits, shared by every collective.

With ``UNIDIST_CHECK_COLLECTIVES`` every rank of a communicator compares a fingerprint of the call it is
about to make (sequence number, call, op, dtype, size, root): a rank that took another code path is named
instead of leaving the others waiting or, worse, reducing mismatched data (sum on one rank, max on another
returns a plausible wrong answer). A checked send/recv pair first compares dtype and size, both sides.
Waits are bounded by the watchdog (watchdog.py), not here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from unidist.comm.dtypes import DTYPE_ID, SUPPORTED_DTYPES
from unidist.errors import CollectiveMismatchError, InvalidArgumentError
from unidist.ops import ReduceOp

__all__ = ["CALLS", "check_rank", "check_tag", "p2p_header", "p2p_mismatch", "signature"]

CALLS = ("barrier", "broadcast", "allreduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
         "send", "recv")
_CALL_ID = {n: i for i, n in enumerate(CALLS)}
_OP_ID = {op: i for i, op in enumerate(ReduceOp)}


def check_rank(value: object, size: int, what: str = "root") -> int:
    """A rank of a communicator of ``size``; integer-likes (numpy ints, 0-d tensors) are accepted."""
    if isinstance(value, torch.Tensor) and (value.numel() != 1 or value.is_floating_point()):
        raise InvalidArgumentError(f"{what}={value!r} is not an integer rank (0..{size - 1}): a tensor rank must "
                                   "hold one integer")
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
    """Every rank of ``comm`` compares what it is about to call.

    Cheap enough to leave on while developing: one in-place MAX allreduce of two int64 words, a fingerprint
    ``f`` of (call number, call, op, dtype, size, root) and ``-f``; the ranks hold the same ``f`` exactly when
    ``max(f) == -max(-f)``. Only when they differ do they exchange the full rows to say who called what
    (every rank sees the same result, so all of them take that path together).
    """
    comm._seq += 1
    dtype_id = DTYPE_ID.get(t.dtype, -1) if t is not None else -1
    n = numel if numel is not None else (t.numel() if t is not None else -1)
    row = (comm._seq, _CALL_ID[call], _OP_ID[op] if op is not None else -1, dtype_id, n, root)
    fp = hash(row) & _MASK  # a tuple of ints hashes the same in every process (no hash randomisation)
    arr = comm._check_np
    arr[0], arr[1] = fp, -fp
    comm._allreduce(comm._check_buf, comm._check_buf, ReduceOp.MAX)
    if arr[0] + arr[1]:
        _explain(comm, row)


_MASK = (1 << 62) - 1


def _explain(comm: Any, row: tuple[int, ...]) -> None:
    """The ranks disagree: gather every rank's row and raise naming what each called."""
    mine = torch.tensor(row, dtype=torch.int64)
    table = torch.empty(comm._size * len(row), dtype=torch.int64)
    comm._allgather(mine, table, [len(row)] * comm._size)
    rows = table.view(comm._size, -1).tolist()
    calls = "; ".join(f"rank {r} called {_describe(v)} as collective #{v[0]}" for r, v in enumerate(rows))
    raise CollectiveMismatchError(
        f"collective #{row[0]} does not match across ranks: {calls}. Every rank must make the same collective "
        "calls, with matching dtypes, sizes, ops and roots, in the same order."
    )


def p2p_header(t: torch.Tensor) -> torch.Tensor:
    """What a checked send announces and a checked recv answers: dtype, element count, shape rank."""
    return torch.tensor([DTYPE_ID[t.dtype], t.numel(), t.dim()], dtype=torch.int64)


def p2p_mismatch(side: str, peer: int, tag: int, mine: torch.Tensor, theirs: list[int]) -> CollectiveMismatchError:
    """The error both sides of a mismatched send/recv raise, before any data moved."""
    def what(h: list[int]) -> str:
        return f"{h[1]} elements of {str(SUPPORTED_DTYPES[h[0]]).replace('torch.', '')}"
    other = "receiver" if side == "send" else "sender"
    return CollectiveMismatchError(
        f"{side} with rank {peer} (tag {tag}): this rank has {what(p2p_header(mine).tolist())} but the {other} "
        f"has {what(theirs)}; a send and its recv need the same dtype and number of elements. Nothing was "
        "transferred."
    )


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
