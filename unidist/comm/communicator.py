"""Communicator: the whole collective API over one engine, for the world (the Manager) and for groups.

The tensor collectives are ``Collectives``'; here are the rest, written on the same bound primitives: fused
(grouped) allreduces, blocking ``send``/``recv`` with the desync check's dtype-and-size handshake (both sides
raise before any data moves) and a refusal of exchanges with oneself, and collectives of picklable Python
objects, moved as bytes. Peers are trusted: what they send is unpickled (README, "Security").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unidist.comm import check
from unidist.comm.collectives import Collectives
from unidist.comm.dtypes import Tensorish, from_bytes, to_bytes
from unidist.comm.engine import Engine
from unidist.comm.work import Array
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp, resolve_op

__all__ = ["Communicator"]

_INT64 = torch.int64


class Communicator(Collectives):
    """Every collective over one engine; ranks (``root``, ``dest``, ``source``) are this communicator's."""

    @property
    def engine(self) -> Engine:
        """The backend's primitives under this communicator (a group's is a sub-engine of the world's)."""
        self._need_started()
        return self._engine

    @property
    def overlaps(self) -> bool:
        """Whether an async collective progresses while this process computes (``Engine.progresses_alone``):
        where it does not, starting one early, during backward, gains nothing."""
        self._need_started()
        return bool(self._engine.progresses_alone)

    @property
    def reduce_alone_from(self) -> float:
        """Bytes from which a gradient is cheaper to reduce in its own storage than to copy into a fusion bucket
        (``Engine.reduce_alone_from``)."""
        self._need_started()
        return float(self._engine.reduce_alone_from)

    @property
    def checks_collectives(self) -> bool:
        """Whether calls are compared across ranks before they run (UNIDIST_CHECK_COLLECTIVES, 2+ ranks)."""
        return self._checked

    @property
    def rank(self) -> int:
        """This process's rank in this communicator."""
        self._need_started()
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in this communicator."""
        self._need_started()
        return self._size

    def mean(self, value: float | torch.Tensor) -> float:
        """The mean of a scalar over ranks, for logging metrics."""
        t = value.detach().reshape(1).to(torch.float64) if isinstance(value, torch.Tensor) else \
            torch.tensor([float(value)], dtype=torch.float64)
        return float(self.allreduce_(t.cpu(), ReduceOp.MEAN).item())

    # ----------------------------------------------------------------- fused reductions
    def grouped_allreduce(self, xs: Sequence[Array], op: ReduceOp | str = ReduceOp.SUM) -> list[Array]:
        """Allreduce many tensors in one exchange per dtype (fused into a flat buffer)."""
        return self._grouped(xs, op, inplace=False)

    def grouped_allreduce_(self, xs: Sequence[Array], op: ReduceOp | str = ReduceOp.SUM) -> list[Array]:
        """In-place grouped allreduce; returns the inputs."""
        return self._grouped(xs, op, inplace=True)

    def _grouped(self, xs: Sequence[Array], op: ReduceOp | str, inplace: bool) -> list[Any]:
        rop = resolve_op(op)
        if not self._checked and xs:  # the engine's own fused call, where it has one for these tensors
            native = self._engine.grouped_allreduce(xs, rop, inplace)
            if native is not None:
                return native
        items = [self._input(x) for x in xs]
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, (t, _) in enumerate(items):
            groups.setdefault((t.dtype, t.device), []).append(i)
        results: list[Any] = [None] * len(items)
        for idx in groups.values():
            flat = torch.cat([items[i][0].reshape(-1) for i in idx])
            self._signature("allreduce", flat, rop)
            work, post = self._reduce_with(self._allreduce, flat, flat, rop)
            work.wait()
            if post is not None:
                post()
            offset = 0
            for i in idx:
                t, as_np = items[i]
                piece = flat[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()
                if inplace:
                    dst, writeback = self._inplace(xs[i])
                    dst.copy_(piece)
                    if writeback is not None:
                        writeback()
                    results[i] = xs[i]
                else:
                    results[i] = self._output(piece, as_np)
        return results

    # ----------------------------------------------------------------- point to point
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

    # ----------------------------------------------------------------- Python objects
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Root's picklable object on every rank (root gets its own object back)."""
        root = self._check_root(root)
        self._signature("broadcast", root=root)
        if self._rank == root:
            payload = to_bytes(obj)
            length = torch.tensor([payload.numel()], dtype=_INT64)
        else:
            length = torch.zeros(1, dtype=_INT64)
        self._broadcast(length, root)
        if self._rank != root:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(payload, root)
        return obj if self._rank == root else from_bytes(payload.numpy())

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, as a list indexed by rank."""
        out, rows = self._allgather_rows("allgather", to_bytes(obj))
        data, objs, start = out.numpy(), [], 0
        for n in rows:
            objs.append(from_bytes(data[start:start + n]))
            start += n
        return objs
