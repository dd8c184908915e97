"""Mismatches caught without the check mode: point-to-point messages that do not fit, and engine errors that mean
the ranks disagree.

A ``recv`` whose buffer differs from the message in size or dtype used to return plausible garbage (MPI and gloo
both accept a shorter message: ``[0, 1, 2, 3, -1, -1, -1, -1]`` for 4 floats sent into 8). By default:

- MPI compares the receive status's element count with the buffer (no extra message); a longer message is MPI's
  truncation error. The receiver raises; it sends a verdict to the sender on the desync check's communicator, and
  the sender raises at its next point-to-point call on that communicator (``MPIEngine``). A message of another
  dtype of the same element width (float32 vs int32) has the same count: only the check mode sees it.
- gloo engines (torch, DeepSpeed, Horovod's side group) frame every message with a 32-byte header (dtype, element
  count): in the same message as the payload up to ``INLINE_MAX`` bytes, as a message of its own above. The
  receiver reads the header, drains a mismatched payload (so the channel stays in step) and raises. gloo has no
  probe: the receiver leaves its verdict for the sender in the job's key-value store (``Verdicts``), and the
  sender raises at its next barrier and when it leaves its ``with`` block, as on MPI.

Engine errors that mean a mismatch (MPI truncation, Horovod's "Mismatched ...", gloo's lost peer) are wrapped by
``typed`` in a unidist error naming the call and pointing to ``UNIDIST_CHECK_COLLECTIVES=1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from unidist.comm.dtypes import DTYPE_ID, SUPPORTED_DTYPES
from unidist.errors import EngineMismatchError, MessageMismatchError, PeerLostError, UnidistError

__all__ = ["HEADER_BYTES", "INLINE_MAX", "Framing", "Verdicts", "message_error", "retype", "typed"]

MAGIC = 0x756E6964  # "unid": a frame from a peer that does not frame is refused, not misread
HEADER_WORDS = 4  # magic, dtype id, element count, payload inline (1) or in a message of its own (0)
HEADER_BYTES = 8 * HEADER_WORDS
INLINE_MAX = 64 << 10  # payloads up to this travel in the header's message (one copy each side)
HINT = ("run with UNIDIST_CHECK_COLLECTIVES=1 to have every call compared across ranks, naming what each "
        "rank called")


def _what(dtype_id: int, numel: int) -> str:
    if not 0 <= dtype_id < len(SUPPORTED_DTYPES):
        return f"{numel} elements"
    return f"{numel} elements of {str(SUPPORTED_DTYPES[dtype_id]).replace('torch.', '')}"


def message_error(side: str, peer: int, tag: int, mine: tuple[int, int], theirs: tuple[int, int] | None,
                  later: bool = False, sender_told: bool = False) -> MessageMismatchError:
    """The error of one side of a mismatched pair; ``mine``/``theirs`` are (dtype id, element count), theirs
    None when the engine only said the message was longer than the buffer; ``sender_told``: the receiver has left
    the sender its verdict (it raises at its next barrier)."""
    other = "receiver's buffer" if side == "send" else "message"
    have = "this rank sent" if side == "send" else "this rank's buffer holds"
    told = _what(*theirs) if theirs is not None else "more than fits (the engine truncated it)"
    when = "an earlier " if later else ""
    way = "to" if side == "send" else "from"
    return MessageMismatchError(
        f"{when}{side} {way} rank {peer} (tag {tag}) did not match: {have} {_what(*mine)}, the {other} has {told}. "
        "A send and its recv need the same dtype and number of elements; the received data was discarded"
        f"{' (the sender is told at its next barrier)' if sender_told else ''}. To find which call diverged, {HINT}.")


class Verdicts:
    """Refused messages told to their senders through the job's key-value store (the rendezvous store the gloo
    group was made on), one object per Manager, shared by its groups.

    A receiver that refuses a message leaves the sender's error under the sender's world rank (the first one
    stays); the sender looks at its next barrier and when it leaves (``pending``), after the call, so no peer is
    left waiting. A look is one store round trip (22 us on one host, measured), paid only by a rank that sent a
    message since its last look: the fast path only sets ``sent``.
    """

    def __init__(self, store: Any, world_rank: int) -> None:
        self._store, self._key = store, self._key_of(world_rank)
        self.sent = False  # a message left this rank since the last look

    @staticmethod
    def _key_of(world_rank: int) -> str:
        return f"unidist/refused/{world_rank}"

    def tell(self, sender: int, error: MessageMismatchError) -> None:
        """Leave ``error`` for the rank ``sender`` (its world rank); best effort: the receiver raises anyway."""
        with contextlib.suppress(Exception):  # the store may be gone with a failing job; the receiver's error stands
            self._store.compare_set(self._key_of(sender), "", str(error))

    def pending(self) -> MessageMismatchError | None:
        """The sender's side: the error a receiver left for this rank, if any (taken: it is said once)."""
        if not self.sent:
            return None
        self.sent = False
        try:
            if not self._store.check([self._key]):
                return None
            text = self._store.get(self._key).decode()
            self._store.delete_key(self._key)
        except Exception:  # a store gone at the job's end: nothing more can be said
            return None
        return MessageMismatchError(text)


class Framing:
    """Header framing of one gloo channel's messages (``send``/``recv`` are the engine's raw blocking calls).

    Both directions reuse one buffer each (the calls are blocking), and the header's words are written and read
    through numpy views: a frame costs one copy of the payload each side, and no tensor is made per call.
    ``verdicts`` tells a sender whose message this rank refused (``rank`` is this rank in the channel's
    numbering, ``world`` maps the channel's ranks to the store's); without it only the receiver raises."""

    def __init__(self, send: Callable[[torch.Tensor, int, int], None],
                 recv: Callable[[torch.Tensor, int, int], None], *, rank: int = -1,
                 world: Callable[[int], int] = int, verdicts: Verdicts | None = None) -> None:
        self._send, self._recv = send, recv
        self._rank, self._world = rank, world
        self.verdicts = verdicts  # shared with the channels of the same Manager's groups
        self._out = torch.empty(HEADER_BYTES + INLINE_MAX, dtype=torch.uint8)  # every frame is built here
        self._out_words = self._out[:HEADER_BYTES].view(torch.int64).numpy()
        self._out_words[0] = MAGIC
        self._box = torch.empty(HEADER_BYTES + INLINE_MAX, dtype=torch.uint8)  # every first message lands here
        self._words = self._box[:HEADER_BYTES].view(torch.int64).numpy()

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)

    def pending(self) -> MessageMismatchError | None:
        """A refused message's error left for this rank by its receiver (``Verdicts.pending``), or None."""
        return None if self.verdicts is None else self.verdicts.pending()

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        nbytes = t.numel() * t.element_size()
        inline = nbytes <= INLINE_MAX
        words = self._out_words
        words[1], words[2], words[3] = DTYPE_ID[t.dtype], t.numel(), inline
        if self.verdicts is not None:
            self.verdicts.sent = True
        if inline:
            frame = self._out[:HEADER_BYTES + nbytes]
            if nbytes:
                frame[HEADER_BYTES:].copy_(self._bytes(t))
            self._send(frame, dest, tag)
            return
        self._send(self._out[:HEADER_BYTES], dest, tag)
        self._send(t, dest, tag)

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        words = self._words
        words[0] = 0  # a message shorter than a header leaves the rest as it was: never read a stale one
        self._recv(self._box, source, tag)
        magic, dtype_id, numel, inline = words.tolist()
        if magic != MAGIC:
            raise MessageMismatchError(
                f"recv from rank {source} (tag {tag}): the message is not one unidist framed (a raw engine send, "
                f"or a peer running another unidist); {HINT}.")
        mine = (DTYPE_ID[t.dtype], t.numel())
        if (dtype_id, numel) != mine:
            if not inline:  # drain the payload: the next message on this channel must be the next one sent
                width = SUPPORTED_DTYPES[dtype_id].itemsize if 0 <= dtype_id < len(SUPPORTED_DTYPES) else 1
                self._recv(torch.empty(numel * width, dtype=torch.uint8), source, tag)
            if self.verdicts is not None:
                self.verdicts.tell(self._world(source),
                                   message_error("send", self._rank, tag, (dtype_id, numel), mine, later=True))
            raise message_error("recv", source, tag, mine, (dtype_id, numel), sender_told=self.verdicts is not None)
        if not inline:
            self._recv(t, source, tag)
        elif numel:
            self._bytes(t).copy_(self._box[HEADER_BYTES:HEADER_BYTES + t.numel() * t.element_size()])


# engine words that mean "the ranks disagree", and the typed error each becomes
_ENGINE_MISMATCH = ("Message truncated", "MPI_ERR_TRUNCATE", "Mismatched ")
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def retype(exc: Exception, what: str, args: tuple[Any, ...], describe: Callable[[tuple[Any, ...]], str]) -> None:
    """Raise ``typed(...)`` from ``exc`` when it differs from ``exc`` (the watchdog calls this as an engine error
    leaves a watched call); else return, and the caller re-raises ``exc``."""
    new = typed(exc, what, args, describe)
    if new is not exc:
        raise new from exc


def typed(exc: Exception, what: str, args: tuple[Any, ...], describe: Callable[[tuple[Any, ...]], str]
          ) -> Exception:
    """``exc`` as a unidist error naming the call when its words mean a mismatch or a lost peer; else ``exc``."""
    if isinstance(exc, UnidistError):
        return exc
    text = str(exc)
    call = f"{what}{describe(args)}"
    if any(w in text for w in _ENGINE_MISMATCH):
        return EngineMismatchError(
            f"{call}: the ranks disagree about this call (the engine said: {text.strip()[:300]}); a message or "
            f"collective's size, dtype or op differs between ranks. {HINT}.")
    if any(w in text for w in _PEER_LOST):
        return PeerLostError(
            f"{call}: a peer closed its connection (the engine said: {text.strip()[:300]}): it died, or it "
            f"raised on a mismatched call (a size or dtype that differs between ranks) and left. {HINT}.")
    return exc
