"""Argument checks, desync signatures and bounded waits, shared by every collective.

With ``UNIDIST_CHECK_COLLECTIVES`` every rank of a communicator compares a signature of the call it is
about to make (sequence number, call, op, dtype, size, root): a rank that took another code path is named
instead of leaving the others waiting or, worse, reducing mismatched data (sum on one rank, max on another
returns a plausible wrong answer). ``DesyncCheck`` is that check's state and exchange, one per communicator. A
checked send/recv pair first compares dtype and size, both sides. Waits are bounded by the watchdog (watchdog.py),
not here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from unidist.comm.dtypes import DTYPE_ID, SUPPORTED_DTYPES
from unidist.comm.primitives import CALLS  # the collectives a signature names (declared there)
from unidist.errors import CollectiveMismatchError, InvalidArgumentError, MessageMismatchError
from unidist.ops import ReduceOp

if TYPE_CHECKING:
    from unidist.comm.engine import Engine

__all__ = ["CALLS", "K_MAX", "NEVER", "DesyncCheck", "check_rank", "check_tag", "next_every", "p2p_header",
           "p2p_mismatch"]

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


# One collective in K is checked by default (UNIDIST_CHECK_COLLECTIVES unset): K adapts so that checks take about
# TARGET of the time between them, from 1 (calls long against a check: every one is checked) to K_MAX (tiny calls
# in a tight loop); it at most doubles or halves per check, and the ranks take the largest wish, so they agree.
TARGET = 0.01
K_MAX = 1024
_clock = time.perf_counter
_MASK = (1 << 62) - 1
EXPLAIN_WAIT = 3.0  # seconds to wait for the other ranks' rows after a mismatch


def next_every(every: int, cost: float, since: float) -> int:
    """This rank's wish for the next K: the last check took ``cost`` s, ``since`` s after the check before it
    ended, with K = ``every``; at most double or half of K, within 1..K_MAX."""
    want = int(every * cost / (TARGET * max(since, 1e-9)))
    return min(K_MAX, max(1, every // 2, min(2 * every, want)))


class DesyncCheck:
    """One communicator's desync check: its mode, K, the call count, the last check's cost, and the exchange.

    The communicator counts its calls down itself (an integer on itself: its hot path reads nothing more) and
    calls ``signature`` or ``overlapped`` for a call that is due; after it, the countdown restarts at
    ``countdown``: the distance the ranks agreed on, or 1 while a check failed before they agreed. ``reset``
    starts over in a mode; ``set_every`` resumes the default mode at a given K.
    """

    __slots__ = ("_cost", "_countdown", "_end", "_every", "_every_call", "_exchange", "_exchange_async", "_rank",
                 "_rows", "_sampled", "_seq", "_size", "_words")

    def __init__(self) -> None:
        self._seq = 0  # the call number of the last check (every rank counts alike)
        self._every_call = self._sampled = False
        self._every = self._countdown = NEVER
        self._cost, self._end = 0.0, 0.0
        self._rank, self._size = 0, 1
        self._words: Any = None

    def bind(self, engine: Engine) -> None:
        """Check over ``engine``: its three words (``check_np``: signature, its negation, the wished K) and
        the exchanges of them (``check_exchange``, ``check_exchange_async``, ``check_rows``)."""
        self._rank, self._size = engine.rank, engine.size
        self._words = engine.check_np
        self._exchange, self._exchange_async = engine.check_exchange, engine.check_exchange_async
        self._rows = engine.check_rows

    def reset(self, mode: bool | None) -> None:
        """Start over in ``mode`` (``Config.check_collectives``: True every call, None one in K, False none; one
        rank never checks): the next call is checked, and K adapts from 1."""
        multi = self._size > 1
        self._every_call = mode is True and multi
        self._sampled = mode is None and multi
        self._every = self._countdown = 1 if multi and mode is not False else NEVER
        self._cost, self._end = 0.0, _clock()

    def set_every(self, every: int, cost: float) -> None:
        """In the default mode (one in K), go on from K = ``every`` with a last check that took ``cost`` s (what
        ``every`` and ``cost`` said before), the next check ``every`` calls away: a benchmark that switches
        modes resumes where it was. The other modes' distances are fixed: nothing changes there."""
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidArgumentError(f"set_every(every={every!r}) takes a positive int")
        if self._sampled:
            self._every = self._countdown = every
            self._cost = float(cost)

    @property
    def every_call(self) -> bool:
        """Whether every call is checked (UNIDIST_CHECK_COLLECTIVES=1 on 2+ ranks)."""
        return self._every_call

    @property
    def sampled(self) -> bool:
        """Whether one call in K is checked, K adapting (the default, on 2+ ranks)."""
        return self._sampled

    @property
    def every(self) -> int:
        """K: the calls between two checks the ranks last agreed on (1 when every call is checked; ``NEVER``
        when none is)."""
        return self._every

    @property
    def cost(self) -> float:
        """Seconds the last check took."""
        return self._cost

    @property
    def countdown(self) -> int:
        """Calls until the next check, as of the last check or ``reset``: the communicator's own countdown
        restarts here after each."""
        return self._countdown

    def signature(self, call: str, t: torch.Tensor | None, op: ReduceOp | None, root: int,
                  numel: int | None) -> None:
        """Every rank compares what it is about to call, before any data moves.

        One in-place MAX allreduce of three int64 words: a signature ``f`` of (call number, call, op, dtype,
        size, root), ``-f``, and this rank's wish for the distance to the next check (``_propose``); the ranks
        hold the same ``f`` exactly when ``max(f) == -max(-f)``, and all take the largest wish. Only when the
        signatures differ do they exchange the full rows to say who called what (every rank sees the same
        result, so all of them take that path together).
        """
        self._countdown = 1  # due until the ranks agree on the next distance
        row = self._row(call, t, op, root, numel)
        start = _clock()
        self._propose(start)
        self._exchange(call, t, op)  # the watchdog names the checked call if this waits too long
        self._agree(_clock() - start)
        self._compare(row)

    def overlapped(self, call: str, t: torch.Tensor, op: ReduceOp, run: Callable[[], None]) -> None:
        """``signature`` for an allreduce of equal-sized buffers, overlapped with the call itself where the
        engine checks on a channel of its own (MPI): the check is posted, ``run`` makes the call, the check ends
        after.

        Data may have moved when a mismatch is found (sum on one rank, max on another); it is still reported on
        every rank. A peer in a different kind of call leaves this rank in ``run`` until the watchdog's timeout,
        while the peer raises at once; ``signature`` is used where the engine cannot overlap.
        """
        self._countdown = 1
        row = self._row(call, t, op, -1, None)
        start = _clock()
        self._propose(start)
        # one call in K (the default) checks before the call: overlapped, the check slows the call beside it by
        # more than the check's own time, which K's adaptation could not see (measured: 1.05-1.08x, not ~1.01x)
        wait = None if self._sampled else self._exchange_async()
        if wait is None:
            self._exchange(call, t, op)
            self._agree(_clock() - start)
            self._compare(row)
            run()
            return
        posted = _clock()
        # the wait needs no watching: every peer posted its check before the data call this rank got through
        try:
            run()
        except Exception:
            wait()
            self._agree(0.0)
            self._compare(row)  # the failed call was a mismatched one: say so
            raise
        ran = _clock()
        wait()
        self._agree(posted - start + _clock() - ran)
        self._compare(row)

    def _propose(self, now: float) -> None:
        """This rank's wish for the next K, from the last check's cost against the time since it ended."""
        self._words[2] = next_every(self._every, self._cost, now - self._end) if self._sampled else 1

    def _agree(self, cost: float) -> None:
        """After the exchange: every rank's next check is the agreed number of calls away."""
        self._every = self._countdown = int(self._words[2]) if self._sampled else 1
        self._cost, self._end = cost, _clock()

    def _compare(self, row: tuple[int, ...]) -> None:
        """After the exchange: ``max(f) + max(-f)`` is 0 exactly when every rank sent the same signature."""
        if self._words[0] + self._words[1]:
            self._explain(row)

    def _row(self, call: str, t: torch.Tensor | None, op: ReduceOp | None, root: int,
             numel: int | None) -> tuple[int, ...]:
        """This call's row, its signature and its negation written into the words."""
        self._seq += self._every  # the call number: the calls since the last check are this many
        if t is None:
            row = (self._seq, _CALL_ID[call], -1 if op is None else _OP_ID[op], -1, -1 if numel is None else numel,
                   root)
        else:
            row = (self._seq, _CALL_ID[call], -1 if op is None else _OP_ID[op], DTYPE_ID.get(t.dtype, -1),
                   t.numel() if numel is None else numel, root)
        sig = hash(row) & _MASK  # a tuple of ints hashes the same in every process (no hash randomisation)
        words = self._words  # two item writes: a slice write from a tuple costs 0.3 us more
        words[0] = sig
        words[1] = -sig
        return row

    def _explain(self, row: tuple[int, ...]) -> None:
        """The ranks disagree: gather every rank's row and raise naming what each called. A rank blocked in a
        different call cannot answer: after ``EXPLAIN_WAIT`` s this rank raises with what it knows."""
        mine = torch.tensor(row, dtype=torch.int64)
        table = torch.empty(self._size * len(row), dtype=torch.int64)
        work = self._rows(mine, table)
        deadline = time.monotonic() + EXPLAIN_WAIT
        while not work.test():
            if time.monotonic() > deadline:
                raise CollectiveMismatchError(
                    f"collective #{row[0]} does not match across ranks: rank {self._rank} called {_describe(row)}, "
                    f"and some rank did not answer within {EXPLAIN_WAIT:g} s (it is blocked in a different call). "
                    "Every rank must make the same collective calls, with matching dtypes, sizes, ops and roots, in "
                    "the same order.")
            time.sleep(0.001)
        rows = table.view(self._size, -1).tolist()
        calls = "; ".join(f"rank {r} called {_describe(v)} as collective #{v[0]}" for r, v in enumerate(rows))
        sampled = (" Found by the default check of one collective in K: the calls before it were not compared; "
                   "UNIDIST_CHECK_COLLECTIVES=1 compares every call, and names the first that differs."
                   if self._sampled else "")
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
