"""Point to point: blocking ``send``/``recv`` on a communicator's primitives, with the desync check's
dtype-and-size handshake (both sides raise before any data moves) and a refusal of exchanges with oneself."""

from __future__ import annotations

from typing import Any

import torch

from unidist.comm import check
from unidist.comm.dtypes import Tensorish
from unidist.comm.work import Array
from unidist.errors import InvalidArgumentError

__all__ = ["PointToPoint"]

_INT64 = torch.int64


class PointToPoint:
    """``send`` and ``recv`` for Collectives (which supplies the primitives and the input conversion)."""

    _rank: int
    _size: int
    _checked: bool
    _check_root: Any
    _input: Any
    _inplace: Any
    _wired: Any
    _send: Any
    _recv: Any

    def _not_self(self, peer: int, call: str, what: str) -> None:
        """With peers, a blocking exchange with oneself completes on some engines for small messages only and
        hangs or fails on the others: refused. Alone, a rank has a mailbox (a ring of one works unchanged)."""
        if peer == self._rank and self._size > 1:
            verb = "send to" if call == "send" else "receive from"
            raise InvalidArgumentError(f"{call}({what}={peer}): that is this rank; a rank cannot {verb} itself "
                                       "(copy the tensor instead)")

    def send(self, x: Tensorish, dest: int, tag: int = 0) -> None:
        """Blocking send to ``dest``; the receiver calls ``recv`` with a buffer of the same shape and dtype."""
        dest = self._check_root(dest, "dest")
        t, _ = self._input(x)
        tag = check.check_tag(tag)
        self._not_self(dest, "send", "dest")
        if self._checked:  # announce dtype and size; the receiver answers before any data moves
            header = check.p2p_header(t)
            self._send(header, dest, tag)
            answer = torch.empty(3, dtype=_INT64)
            self._recv(answer, dest, tag)
            if answer.tolist()[:2] != header.tolist()[:2]:
                raise check.p2p_mismatch("send", dest, tag, t, answer.tolist())
        self._send(self._wired(t), dest, tag)

    def recv(self, x: Array, source: int, tag: int = 0) -> Array:
        """Receive into x (in place) from ``source``; returns x."""
        source = self._check_root(source, "source")
        t, writeback = self._inplace(x)
        tag = check.check_tag(tag)
        self._not_self(source, "recv", "source")
        if self._checked:
            announced, header = torch.empty(3, dtype=_INT64), check.p2p_header(t)
            self._recv(announced, source, tag)
            self._send(header, source, tag)
            theirs = announced.tolist()
            if theirs[:2] != header.tolist()[:2]:
                raise check.p2p_mismatch("recv", source, tag, t, theirs)
        self._recv(self._wired(t), source, tag)
        if writeback is not None:
            writeback()
        return x
