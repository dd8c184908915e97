"""Every engine primitive that moves data, declared once: what it is and what watches it.

An engine (comm/engine.py) moves data only through these methods. Each declaration says the method's name, its
kind (a blocking collective, its asynchronous start, a point-to-point call, or the desync check's own exchange),
the collective it serves (the name the desync check compares, the watchdog reports and the timeline shows: a
prepared or asynchronous variant serves its plain collective), and where the timeline reads its size, op and peer
among its arguments. The tables every other part needs are derived here, never written by hand:

- ``CALLS``: the collectives the desync check numbers (comm/check.py);
- ``WATCHED``, ``ASYNC``, ``POINT_TO_POINT``: what the watchdog wraps (comm/regions.py: a primitive that is not in
  them would run with no timeout, no stall verdict and no timeline entry), and ``PRIMITIVES`` for the communicator's
  bound methods (comm/binding.py);
- ``TIMELINE``: the fast record's argument positions (comm/timeline.py).

A new collective is one declaration here, its primitive on ``Engine`` (with a default written on the others where
one can be), the communicator's public call (comm/collectives.py) and its line in the ``Comm`` protocol; the test
of this module fails on an Engine method that moves data and is declared nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ASYNC", "ASYNC_START", "BLOCKING", "CALLS", "EXCHANGE", "EXCHANGES", "P2P", "POINT_TO_POINT", "PRIMITIVES",
           "TIMELINE", "WATCHED", "Primitive", "declared", "serves"]

BLOCKING, ASYNC_START, P2P, EXCHANGE = "blocking", "async", "p2p", "exchange"
# (the argument holding the data whose size is recorded, the op's, the peer's or root's, the peer's name)
Positions = tuple["int | None", "int | None", "int | None", str]


@dataclass(frozen=True)
class Primitive:
    """One engine method that moves data.

    Attributes:
        name: the ``Engine`` method.
        kind: ``BLOCKING``, ``ASYNC_START`` (returns a ``Work`` to wait for), ``P2P`` (a send or a receive, whose
            order is per pair, not numbered with the collectives) or ``EXCHANGE`` (the desync check's own).
        serves: the collective it is (a prepared or asynchronous variant serves its plain one).
        positions: where the timeline finds the data, the op and the peer among the arguments; None: the call is
            described in full when its event is written (gather, scatter, grouped calls).
    """

    name: str
    kind: str
    serves: str
    positions: Positions | None = None


_ALLREDUCE: Positions = (0, 2, None, "")
_BROADCAST: Positions = (0, None, 1, "root")
_ALLGATHER: Positions = (1, None, None, "")
_ALLTOALL: Positions = (0, None, None, "")
_REDUCE_SCATTER: Positions = (0, 3, None, "")
_P2P: Positions = (0, None, 1, "peer")

PRIMITIVES: tuple[Primitive, ...] = (
    Primitive("barrier", BLOCKING, "barrier", (None, None, None, "")),
    Primitive("broadcast", BLOCKING, "broadcast", _BROADCAST),
    Primitive("allreduce", BLOCKING, "allreduce", _ALLREDUCE),
    Primitive("allgather", BLOCKING, "allgather", _ALLGATHER),
    Primitive("gather", BLOCKING, "gather"),
    Primitive("scatter", BLOCKING, "scatter"),
    Primitive("reduce_scatter", BLOCKING, "reduce_scatter", _REDUCE_SCATTER),
    Primitive("alltoall", BLOCKING, "alltoall", _ALLTOALL),
    Primitive("send", P2P, "send", _P2P),
    Primitive("recv", P2P, "recv", _P2P),
    Primitive("reduce", BLOCKING, "reduce", (0, 3, 2, "root")),
    Primitive("grouped_allreduce", BLOCKING, "grouped_allreduce"),
    # the same collectives on an engine's arguments prepared once per buffer (comm/plans.py)
    Primitive("allreduce_prepared", BLOCKING, "allreduce", _ALLREDUCE),
    Primitive("broadcast_prepared", BLOCKING, "broadcast", (0, None, 2, "root")),
    Primitive("allgather_prepared", BLOCKING, "allgather", _ALLGATHER),
    Primitive("alltoall_prepared", BLOCKING, "alltoall", _ALLTOALL),
    Primitive("reduce_scatter_prepared", BLOCKING, "reduce_scatter", _REDUCE_SCATTER),
    # started now, waited for later (a Work)
    Primitive("allreduce_async", ASYNC_START, "allreduce", _ALLREDUCE),
    Primitive("reduce_scatter_async", ASYNC_START, "reduce_scatter", _REDUCE_SCATTER),
    Primitive("broadcast_async", ASYNC_START, "broadcast", _BROADCAST),
    Primitive("allgather_async", ASYNC_START, "allgather", _ALLGATHER),
    # the desync check's exchange, named by the call it checks (regions.py watches it so)
    Primitive("check_exchange", EXCHANGE, "check_exchange"),
)

CALLS: tuple[str, ...] = tuple(dict.fromkeys(p.serves for p in PRIMITIVES if p.kind != EXCHANGE))
WATCHED: tuple[str, ...] = tuple(p.name for p in PRIMITIVES if p.kind in (BLOCKING, P2P))
ASYNC: tuple[str, ...] = tuple(p.name for p in PRIMITIVES if p.kind == ASYNC_START)
POINT_TO_POINT: tuple[str, ...] = tuple(p.name for p in PRIMITIVES if p.kind == P2P)
EXCHANGES: tuple[str, ...] = tuple(p.name for p in PRIMITIVES if p.kind == EXCHANGE)
TIMELINE: dict[str, Positions] = {p.name: p.positions for p in PRIMITIVES if p.positions is not None}
_BY_NAME = {p.name: p for p in PRIMITIVES}


def declared(name: str) -> Primitive:
    """The declaration of the engine method ``name`` (a KeyError: it moves no data, or was never declared)."""
    return _BY_NAME[name]


def serves(name: str) -> str:
    """The collective the primitive ``name`` serves (``allreduce`` for ``allreduce_prepared`` and
    ``allreduce_async``); ``name`` itself where it is declared nowhere."""
    p = _BY_NAME.get(name)
    return name if p is None else p.serves
