"""Argument checks, desync fingerprints and bounded waits, shared by every collective.

With ``UNIDIST_CHECK_COLLECTIVES`` every rank of a communicator compares a fingerprint of the call it is
about to make (sequence number, call, op, dtype, size, root): a rank that took another code path is named
instead of leaving the others waiting or, worse, reducing mismatched data (sum on one rank, max on another
returns a plausible wrong answer). A checked send/recv pair first compares dtype and size, both sides.
Waits are bounded by the watchdog (watchdog.py), not here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from unidist.comm.dtypes import DTYPE_ID, SUPPORTED_DTYPES
from unidist.errors import CollectiveMismatchError, InvalidArgumentError, MessageMismatchError
from unidist.ops import ReduceOp

__all__ = ["CALLS", "K_MAX", "NEVER", "check_rank", "check_tag", "overlapped", "p2p_header", "p2p_mismatch",
           "signature"]

CALLS = ("barrier", "broadcast", "allreduce", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
         "send", "recv")
NEVER = 1 << 62  # the countdown of a communicator that never checks (one rank, or UNIDIST_CHECK_COLLECTIVES=0)
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
    """Every rank of ``comm`` compares what it is about to call, before any data moves.

    One in-place MAX allreduce of three int64 words: a fingerprint ``f`` of (call number, call, op, dtype, size,
    root), ``-f``, and this rank's wish for the distance to the next check (``_propose``); the ranks hold the
    same ``f`` exactly when ``max(f) == -max(-f)``, and all take the largest wish. Only when the fingerprints
    differ do they exchange the full rows to say who called what (every rank sees the same result, so all of
    them take that path together).
    """
    row = _row(comm, call, t, op, root, numel)
    start = _clock()
    _propose(comm, start)
    comm._check_exchange(call, t, op)  # the watchdog names the checked call if this waits too long
    _agree(comm, start, _clock() - start)
    _compare(comm, row)


def overlapped(comm: Any, call: str, t: torch.Tensor, op: ReduceOp, run: Callable[[], None]) -> None:
    """``signature`` for an allreduce of equal-sized buffers, overlapped with the call itself where the engine
    checks on a channel of its own (MPI): the check is posted, ``run`` makes the call, the check ends after.

    Data may have moved when a mismatch is found (sum on one rank, max on another); it is still reported on
    every rank. A peer in a different kind of call leaves this rank in ``run`` until the watchdog's timeout,
    while the peer raises at once; ``signature`` is used where the engine cannot overlap.
    """
    row = _row(comm, call, t, op, -1, None)
    start = _clock()
    _propose(comm, start)
    # one call in K (the default) checks before the call: overlapped, the check slows the call beside it by more
    # than the check's own time, which K's adaptation could not see (measured: 1.05-1.08x instead of ~1.01x)
    wait = None if comm._sampled else comm._check_exchange_async()
    if wait is None:
        comm._check_exchange(call, t, op)
        _agree(comm, start, _clock() - start)
        _compare(comm, row)
        run()
        return
    posted = _clock()
    # the wait needs no watching: every peer posted its check before the data call this rank got through
    try:
        run()
    except Exception:
        wait()
        _agree(comm, start, 0.0)
        _compare(comm, row)  # the failed call was a mismatched one: say so
        raise
    ran = _clock()
    wait()
    _agree(comm, start, posted - start + _clock() - ran)
    _compare(comm, row)


# One collective in K is checked by default (UNIDIST_CHECK_COLLECTIVES unset): K adapts so that checks take about
# TARGET of the time between them, from 1 (calls long against a check: every one is checked) to K_MAX (tiny calls
# in a tight loop); it at most doubles or halves per check, and the ranks take the largest wish, so they agree.
TARGET = 0.01
K_MAX = 1024
_clock = time.perf_counter


def _propose(comm: Any, now: float) -> None:
    """This rank's wish for the next K, from the last check's cost against the time since it ended."""
    every = comm._every
    if not comm._sampled:
        comm._check_np[2] = 1
        return
    want = int(every * comm._check_cost / (TARGET * max(now - comm._check_end, 1e-9)))
    comm._check_np[2] = min(K_MAX, max(1, every // 2, min(2 * every, want)))


def _agree(comm: Any, start: float, cost: float) -> None:
    """After the exchange: every rank's next check is the agreed number of calls away."""
    comm._every = comm._left = int(comm._check_np[2]) if comm._sampled else 1
    comm._check_cost, comm._check_end = cost, _clock()


def _compare(comm: Any, row: tuple[int, ...]) -> None:
    """After the exchange: ``max(f) + max(-f)`` is 0 exactly when every rank sent the same fingerprint."""
    if comm._check_np[0] + comm._check_np[1]:
        _explain(comm, row)


def _row(comm: Any, call: str, t: torch.Tensor | None, op: ReduceOp | None, root: int,
         numel: int | None) -> tuple[int, ...]:
    """This call's row, its fingerprint and its negation written into ``comm._check_np``."""
    comm._seq += comm._every  # the call number: the calls since the last check are this many
    if t is None:
        row = (comm._seq, _CALL_ID[call], -1 if op is None else _OP_ID[op], -1, -1 if numel is None else numel, root)
    else:
        row = (comm._seq, _CALL_ID[call], -1 if op is None else _OP_ID[op], DTYPE_ID.get(t.dtype, -1),
               t.numel() if numel is None else numel, root)
    fp = hash(row) & _MASK  # a tuple of ints hashes the same in every process (no hash randomisation)
    arr = comm._check_np  # two item writes: a slice write from a tuple costs 0.3 us more
    arr[0] = fp
    arr[1] = -fp
    return row


_MASK = (1 << 62) - 1
EXPLAIN_WAIT = 3.0  # seconds to wait for the other ranks' rows after a mismatch


def _explain(comm: Any, row: tuple[int, ...]) -> None:
    """The ranks disagree: gather every rank's row and raise naming what each called. A rank blocked in a
    different call cannot answer: after ``EXPLAIN_WAIT`` s this rank raises with what it knows."""
    mine = torch.tensor(row, dtype=torch.int64)
    table = torch.empty(comm._size * len(row), dtype=torch.int64)
    work = comm._check_rows(mine, table)
    deadline = time.monotonic() + EXPLAIN_WAIT
    while not work.test():
        if time.monotonic() > deadline:
            raise CollectiveMismatchError(
                f"collective #{row[0]} does not match across ranks: rank {comm._rank} called {_describe(row)}, and "
                f"some rank did not answer within {EXPLAIN_WAIT:g} s (it is blocked in a different call). Every "
                "rank must make the same collective calls, with matching dtypes, sizes, ops and roots, in the "
                "same order.")
        time.sleep(0.001)
    rows = table.view(comm._size, -1).tolist()
    calls = "; ".join(f"rank {r} called {_describe(v)} as collective #{v[0]}" for r, v in enumerate(rows))
    sampled = (" Found by the default check of one collective in K: the calls before it were not compared; "
               "UNIDIST_CHECK_COLLECTIVES=1 compares every call, and names the first that differs."
               if comm._sampled else "")
    raise CollectiveMismatchError(
        f"collective #{row[0]} does not match across ranks: {calls}. Every rank must make the same collective "
        f"calls, with matching dtypes, sizes, ops and roots, in the same order.{sampled}"
    )


def p2p_header(t: torch.Tensor) -> torch.Tensor:
    """What a checked send announces and a checked recv answers: dtype, element count, shape rank."""
    return torch.tensor([DTYPE_ID[t.dtype], t.numel(), t.dim()], dtype=torch.int64)


def p2p_mismatch(side: str, peer: int, tag: int, mine: torch.Tensor, theirs: list[int]) -> MessageMismatchError:
    """The error both sides of a mismatched send/recv raise, before any data moved."""
    def what(h: list[int]) -> str:
        return f"{h[1]} elements of {str(SUPPORTED_DTYPES[h[0]]).replace('torch.', '')}"
    other = "receiver" if side == "send" else "sender"
    way = "to" if side == "send" else "from"
    return MessageMismatchError(
        f"{side} {way} rank {peer} (tag {tag}): this rank has {what(p2p_header(mine).tolist())} but the {other} "
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
