"""Each engine primitive that moves data is declared once (unidist/comm/primitives.py), and nothing that moves data
runs unwatched: every table the watchdog, the desync check, the timeline and the communicator's binding use is the
declaration's, and an Engine method that moves data without a declaration fails here."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from unidist.comm import check, primitives, regions, timeline
from unidist.comm.binding import EngineBinding
from unidist.comm.engine import Engine
from unidist.ops import ReduceOp

# Engine's public methods that move no data of a collective, each with why (a new method is one of these or declared)
MOVES_NO_DATA = {
    "sub": "makes the engines of groups (each engine makes its own: a collective of the library, not a primitive)",
    "abort": "ends the job",
    "close": "frees what the engine holds",
    "prepared_sum": "builds an allreduce's arguments once per buffer; allreduce_prepared moves the data",
    "prepared_buffer": "builds a broadcast's arguments; broadcast_prepared moves the data",
    "prepared_blocks": "builds the arguments of equal-block calls; the *_prepared calls move the data",
    "pending_mismatch": "reads a receiver's verdict that already arrived (comm/mismatch.py)",
    "check_exchange_async": "the desync check's exchange started beside the call it checks, waited inside that call's "
                            "watched region (check.py)",
    "check_rows": "the desync check's rows after a mismatch, bounded by its own deadline (check.EXPLAIN_WAIT)",
}


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)}


def test_every_engine_method_that_moves_data_is_declared() -> None:
    declared = {p.name for p in primitives.PRIMITIVES}
    methods = _public_methods(Engine)
    assert methods - declared - set(MOVES_NO_DATA) == set(), "declare these in comm/primitives.py (or say here why " \
        f"they move no data): {sorted(methods - declared - set(MOVES_NO_DATA))}"
    assert declared <= methods, f"declared but not Engine methods: {sorted(declared - methods)}"
    assert not declared & set(MOVES_NO_DATA)


def test_the_tables_are_the_declarations() -> None:
    data = [p for p in primitives.PRIMITIVES if p.kind != primitives.EXCHANGE]
    assert check.CALLS is primitives.CALLS and set(check.CALLS) == {p.serves for p in data}
    assert "reduce" in check.CALLS
    names = [p.name for p in primitives.PRIMITIVES]
    assert sorted([*primitives.WATCHED, *primitives.ASYNC, *primitives.EXCHANGES]) == sorted(names)
    assert set(primitives.POINT_TO_POINT) == {"send", "recv"} <= set(primitives.WATCHED)
    assert timeline._FAST is primitives.TIMELINE
    annotated = {n.removeprefix("_") for n in EngineBinding.__annotations__ if n.startswith("_")}
    assert set(names) <= annotated, f"type these in EngineBinding: {sorted(set(names) - annotated)}"


class _Two(Engine):
    """An engine of 2 ranks whose primitives record their calls (nothing moves)."""

    def __init__(self) -> None:
        super().__init__(0, 2)
        self.made: list[str] = []

    def barrier(self) -> None:
        self.made.append("barrier")

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self.made.append("broadcast")

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        self.made.append("allreduce")

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        self.made.append("allgather")

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                 recv_counts: Sequence[int]) -> None:
        self.made.append("alltoall")

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self.made.append("send")

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        self.made.append("recv")

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        return [None for _ in lists]


def test_the_watchdog_watches_every_declared_primitive() -> None:
    engine = _Two()
    watched = regions.watch(engine)
    for name in (*primitives.WATCHED, *primitives.ASYNC, *primitives.EXCHANGES):
        assert getattr(watched, name) != getattr(engine, name), f"{name} would run unwatched"
    before = regions.calls()
    t = torch.zeros(3)
    watched.reduce(t, t, 1, ReduceOp.SUM)  # the default reduce, written on allreduce: one watched call
    assert regions.calls() == before + 1 and engine.made == ["allreduce"]
