"""The default mismatch guards' logic in one process: gloo header framing over a channel with gloo's semantics
(a shorter message fills part of the buffer, a longer one is an error), engine errors typed, the one-in-K
countdown and its adaptation. The real engines run the same cases under every launcher (tests/workers/
collectives.py, ``default_guard[...]``)."""

from __future__ import annotations

import types
from collections import deque

import pytest
import torch

import unidist
from unidist.comm import check, mismatch, watchdog
from unidist.comm.engine import SoloEngine
from unidist.config import Config


class _Gloo:
    """Messages between two ranks as gloo moves them: per (peer, tag) in order; a receive buffer may be larger than
    the message (the rest is left as it was), never smaller."""

    def __init__(self) -> None:
        self.queues: dict[int, deque[torch.Tensor]] = {}
        self.sent = 0

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self.sent += 1
        self.queues.setdefault(tag, deque()).append(t.reshape(-1).view(torch.uint8).clone())

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        msg = self.queues[tag].popleft()
        dst = t.reshape(-1).view(torch.uint8)
        if msg.numel() > dst.numel():
            raise RuntimeError(f"[gloo] message of {msg.numel()} bytes into a buffer of {dst.numel()}")
        dst[: msg.numel()].copy_(msg)


@pytest.mark.parametrize("n", [0, 5, mismatch.INLINE_MAX // 4, mismatch.INLINE_MAX // 4 + 1, 40000])
def test_a_matching_message_arrives_whole(n: int) -> None:
    wire = _Gloo()
    framing = mismatch.Framing(wire.send, wire.recv)
    sent = torch.arange(n, dtype=torch.float32)
    framing.send(sent, 1, 7)
    assert wire.sent == (1 if n * 4 <= mismatch.INLINE_MAX else 2)  # inline up to 64 KiB, a header of its own above
    got = torch.full((n,), -1.0)
    framing.recv(got, 0, 7)
    assert torch.equal(got, sent)


@pytest.mark.parametrize(("sent", "buf", "words"), [
    (torch.arange(4.0), torch.full((8,), -1.0), "holds 8 elements of float32, the message has 4 elements of float32"),
    (torch.arange(8.0), torch.full((4,), -1.0), "holds 4 elements of float32, the message has 8 elements"),
    (torch.arange(4, dtype=torch.int32), torch.full((4,), -1.0), "the message has 4 elements of int32"),
    (torch.arange(30000.0), torch.full((20000,), -1.0), "the message has 30000 elements"),
    (torch.arange(20000.0), torch.full((30000,), -1.0), "the message has 20000 elements"),
])
def test_a_mismatched_message_raises_and_the_channel_stays_in_step(sent: torch.Tensor, buf: torch.Tensor,
                                                                  words: str) -> None:
    wire = _Gloo()
    framing = mismatch.Framing(wire.send, wire.recv)
    framing.send(sent, 1, 3)
    framing.send(torch.arange(3.0), 1, 3)
    before = buf.clone()
    with pytest.raises(unidist.MessageMismatchError, match="UNIDIST_CHECK_COLLECTIVES=1") as info:
        framing.recv(buf, 0, 3)
    assert "recv from rank 0 (tag 3)" in str(info.value) and words in str(info.value)
    assert torch.equal(buf, before), "a refused message must not be written into the buffer"
    nxt = torch.zeros(3)
    framing.recv(nxt, 0, 3)  # the next message is the next one sent: the refused payload was drained
    assert torch.equal(nxt, torch.arange(3.0))


def test_the_sender_is_told_through_the_store() -> None:
    """Rank 1 refuses rank 0's message: it leaves rank 0's error in the store (under rank 0's world rank) and says
    so; rank 0 finds it at its next look, once, naming the receiver, the tag and both sizes; a rank that sent
    nothing since its last look does not ask the store."""
    import torch.distributed as dist

    store = dist.HashStore()
    wire = _Gloo()
    sender = mismatch.Framing(wire.send, wire.recv, rank=0, verdicts=mismatch.Verdicts(store, 0))
    receiver_verdicts = mismatch.Verdicts(store, 1)
    receiver = mismatch.Framing(wire.send, wire.recv, rank=1, world=lambda r: r, verdicts=receiver_verdicts)
    sender.send(torch.arange(4, dtype=torch.int32), 1, 9)
    with pytest.raises(unidist.MessageMismatchError, match="the sender is told at its next barrier"):
        receiver.recv(torch.zeros(8), 0, 9)
    assert receiver_verdicts.pending() is None  # rank 1 sent nothing: no look
    told = sender.pending()
    assert told is not None and str(told).startswith(
        "an earlier send to rank 1 (tag 9) did not match: this rank sent 4 elements of int32, the receiver's buffer "
        "has 8 elements of float32")
    sender.send(torch.arange(3.0), 1, 9)
    assert sender.pending() is None  # said once
    got = torch.zeros(3)
    receiver.recv(got, 0, 9)
    assert torch.equal(got, torch.arange(3.0))


def test_a_group_tells_the_senders_world_rank() -> None:
    """In a group, the receiver names the sender's group rank to find its world rank (the store's key) and names
    itself by its group rank (the sender's numbering)."""
    import torch.distributed as dist

    store = dist.HashStore()
    wire = _Gloo()
    world = {0: 2, 1: 3}.__getitem__  # group ranks 0, 1 are world ranks 2, 3
    sender = mismatch.Framing(wire.send, wire.recv, rank=0, world=world, verdicts=mismatch.Verdicts(store, 2))
    receiver = mismatch.Framing(wire.send, wire.recv, rank=1, world=world, verdicts=mismatch.Verdicts(store, 3))
    sender.send(torch.arange(4.0), 1, 5)
    with pytest.raises(unidist.MessageMismatchError):
        receiver.recv(torch.zeros(5), 0, 5)
    told = sender.pending()
    assert told is not None and "send to rank 1 (tag 5)" in str(told)


def test_an_unframed_message_is_refused() -> None:
    wire = _Gloo()
    framing = mismatch.Framing(wire.send, wire.recv)
    wire.send(torch.arange(4.0), 1, 0)  # a raw engine send
    with pytest.raises(unidist.MessageMismatchError, match="not one unidist framed"):
        framing.recv(torch.zeros(4), 0, 0)


@pytest.mark.parametrize(("words", "kind"), [
    ("Message truncated; 16 bytes received but buffer size is 8", unidist.EngineMismatchError),
    ("Mismatched allreduce tensor shapes: One rank sent a tensor of shape [4]", unidist.EngineMismatchError),
    ("Read error [127.0.0.1]:1: Connection reset by peer", unidist.PeerLostError),
    ("CUDA out of memory", None),
])
def test_engine_errors_that_mean_a_mismatch_are_typed(words: str, kind: type[Exception] | None) -> None:
    err = RuntimeError(words)
    got = mismatch.typed(err, "allreduce", (torch.zeros(4),), watchdog.describe_args)
    if kind is None:
        assert got is err
        return
    assert isinstance(got, kind) and isinstance(got, RuntimeError)  # `except RuntimeError` still catches it
    assert "allreduce(float32[4])" in str(got) and words in str(got) and "UNIDIST_CHECK_COLLECTIVES=1" in str(got)
    typed_already = unidist.InvalidArgumentError("bad root")
    assert mismatch.typed(typed_already, "broadcast", (), watchdog.describe_args) is typed_already


def test_the_check_mode_setting() -> None:
    assert Config.from_env({}).check_collectives is None  # the default: one in K
    assert Config.from_env({"UNIDIST_CHECK_COLLECTIVES": "auto"}).check_collectives is None
    assert Config.from_env({"UNIDIST_CHECK_COLLECTIVES": "1"}).check_collectives is True
    assert Config.from_env({"UNIDIST_CHECK_COLLECTIVES": "off"}).check_collectives is False


@pytest.mark.parametrize(("every", "cost", "since", "want"), [
    (1, 0.0, 1.0, 1),          # nothing measured yet: K stays
    (8, 3e-6, 8 * 5e-6, 16),   # 3 us checks against 5 us calls: K grows, at most doubling
    (64, 3e-6, 64 * 5e-6, 59),  # 3 us against ~60 calls of 5 us is 1%: K settles there (rounded down)
    (64, 3e-6, 64 * 5e-3, 32),  # calls of 5 ms: a check is nothing, K halves towards 1
    (1024, 1e-3, 1024 * 1e-6, check.K_MAX),  # bounded
])
def test_k_adapts_to_about_one_percent(every: int, cost: float, since: float, want: int) -> None:
    assert check.next_every(every, cost, since) == want


class _Pair(SoloEngine):
    """Two ranks that agree on everything: the check's exchange leaves this rank's words as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 2
        self.exchanges = 0

    def check_exchange(self, *about: object) -> None:
        self.exchanges += 1


def _desync(mode: bool | None) -> tuple[check.DesyncCheck, _Pair]:
    engine = _Pair()
    d = check.DesyncCheck()
    d.bind(engine)
    d.reset(mode)
    return d, engine


def test_the_check_mode_checks_every_call() -> None:
    d, engine = _desync(True)
    assert d.every_call and not d.sampled and d.countdown == d.every == 1
    for _ in range(3):
        d.signature("allreduce", torch.ones(2), unidist.ReduceOp.SUM, -1, None)
        assert d.countdown == d.every == 1
    assert engine.exchanges == 3


def test_the_default_mode_resumes_from_a_given_k() -> None:
    d, _ = _desync(None)
    assert d.sampled and d.countdown == d.every == 1
    d.set_every(64, 3e-6)
    assert d.countdown == d.every == 64 and d.cost == 3e-6
    d.signature("barrier", None, None, -1, None)  # the wish of this rank alone: K moves at most by 2x
    assert 32 <= d.countdown == d.every <= 128
    off, _ = _desync(False)
    off.set_every(64, 3e-6)  # the other modes' distances are fixed
    assert off.countdown == off.every == check.NEVER
    with pytest.raises(unidist.InvalidArgumentError):
        d.set_every(0, 0.0)


def test_a_communicator_restarts_its_countdown_from_its_check() -> None:
    """The Communicator counts down a copy of the check's distance; restarting the check restarts the copy."""
    from unidist.comm import Group

    owner = types.SimpleNamespace(config=Config.from_env({}), device=torch.device("cpu"), started=True)
    g = Group(owner, [0, 1], _Pair())
    assert g.desync_check.sampled and not g.checks_collectives
    g.restart_desync_check(every=8, cost=1e-6)
    assert g.desync_check.every == 8
    engine = g.engine
    assert isinstance(engine, _Pair)
    for _ in range(7):  # not due: nothing exchanged
        g.allreduce_(torch.ones(2))
    assert engine.exchanges == 0
    g.allreduce_(torch.ones(2))  # the 8th call is checked
    assert engine.exchanges == 1
    g.config = Config.from_env({"UNIDIST_CHECK_COLLECTIVES": "1"})
    g.restart_desync_check()
    assert g.checks_collectives and g.desync_check.every_call
    g.allreduce_(torch.ones(2))
    assert engine.exchanges == 2
