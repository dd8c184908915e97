"""MPI's default point-to-point guard: the receive status's count, and a verdict to the sender on a mismatch.

A matching message costs the receiver one ``Get_count`` on the status MPI fills anyway (no extra message) and
the sender nothing. On a mismatch the receiver sends a 4-word verdict to the sender on the desync check's
communicator (``check_comm``: no user or data message can match it) and raises. The sender cannot wait for a
verdict that a matching message never produces, and probing for one on every call costs ~1.6 us (an
``Iprobe`` here, measured), so it looks at its next ``barrier`` and when it leaves its ``with`` block
(``pending``), after the call, so no peer is left waiting. See comm/mismatch.py for the gloo engines.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unidist.comm.dtypes import DTYPE_ID, SUPPORTED_DTYPES
from unidist.comm.mismatch import HINT
from unidist.errors import MessageMismatchError

__all__ = ["MessageGuard"]

_TRUNCATED = -1  # the verdict's byte count when MPI refused a longer message


def _what(dtype_id: int, numel: int) -> str:
    dtype = SUPPORTED_DTYPES[dtype_id]
    return f"{numel} elements of {str(dtype).replace('torch.', '')} ({numel * dtype.itemsize} bytes)"


def _message(nbytes: int) -> str:
    return "is longer (MPI truncated it)" if nbytes == _TRUNCATED else f"has {nbytes} bytes"


class MessageGuard:
    """The receive-side count check and the verdicts of one MPI engine (``comm``: its data communicator)."""

    def __init__(self, MPI: Any, comm: Any, check_comm: Any) -> None:
        self._comm, self._check_comm = comm, check_comm
        self._status, self._byte = MPI.Status(), MPI.BYTE
        self._exception, self._truncate = MPI.Exception, MPI.ERR_TRUNCATE
        self._any_source, self._any_tag = MPI.ANY_SOURCE, MPI.ANY_TAG
        self._verdict = np.zeros(4, dtype=np.int64)  # tag, receiver's dtype id, its element count, bytes seen
        self._int64 = MPI.INT64_T

    def recv(self, spec: list[Any], t: torch.Tensor, source: int, tag: int) -> None:
        """``Recv`` into ``spec`` (t's memory), raising MessageMismatchError when the message does not fit."""
        status = self._status
        try:
            self._comm.Recv(spec, source, tag, status)
        except self._exception as err:
            if err.Get_error_class() != self._truncate:
                raise
            raise self._refuse(t, source, tag, _TRUNCATED) from err
        nbytes = status.Get_count(self._byte)
        if nbytes != t.nbytes:
            raise self._refuse(t, source, tag, nbytes)

    def _refuse(self, t: torch.Tensor, source: int, tag: int, nbytes: int) -> MessageMismatchError:
        """Tell the sender (a small eager send: it returns at once), and the receiver's error."""
        mine = (DTYPE_ID[t.dtype], t.numel())
        verdict = self._verdict
        verdict[:] = (tag, mine[0], mine[1], nbytes)
        self._check_comm.Send([verdict, 4, self._int64], source, tag)
        return MessageMismatchError(
            f"recv from rank {source} (tag {tag}) did not match: this rank's buffer holds {_what(*mine)}, the "
            f"message {_message(nbytes)}. A send and its recv need the same dtype and number of elements; the "
            f"received data was discarded (the sender is told at its next barrier). To find which call "
            f"diverged, {HINT}.")

    def pending(self) -> MessageMismatchError | None:
        """The sender's side: an error for a verdict a receiver sent this rank, if one has arrived."""
        status = self._status
        if not self._check_comm.Iprobe(self._any_source, self._any_tag, status):
            return None
        peer = status.Get_source()
        verdict = np.zeros(4, dtype=np.int64)
        self._check_comm.Recv([verdict, 4, self._int64], peer, status.Get_tag())
        tag, dtype_id, numel, nbytes = (int(v) for v in verdict)
        return MessageMismatchError(
            f"an earlier send to rank {peer} (tag {tag}) did not match: the receiver's buffer holds "
            f"{_what(dtype_id, numel)}, the message this rank sent {_message(nbytes)}. A send and its recv need "
            f"the same dtype and number of elements; the receiver raised and discarded it. To find which call "
            f"diverged, {HINT}.")
