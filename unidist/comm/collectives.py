"""Every public tensor collective, written once on an engine's primitives, for the world and for groups.

A communicator (the Manager for the whole world, a Group for a subset) holds an engine (comm/engine.py: the
backend's primitives on contiguous torch tensors) and calls nothing else of the backend. Everything a user
calls — numpy/torch conversion, in-place variants, ``mean``, bool and half-precision handling, uneven sizes,
fused (grouped) reductions, argument checks, desync detection — lives here, in comm/binding.py (the engine's
bound primitives, conversion, the desync countdown) and in comm/communicator.py (point to point, Python objects),
so every backend and every group behaves the same. Ranks (``root``, ``dest``, ``source``) are this
communicator's ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from unidist.comm.binding import EngineBinding
from unidist.comm.dtypes import (
    DTYPE_ID,
    SUPPORTED_DTYPES,
    Tensorish,
    out_tensor,
    row_numel,
    rows_like,
    split_sizes,
)
from unidist.comm.work import Array, Handle, Work
from unidist.errors import CollectiveMismatchError, InvalidArgumentError
from unidist.ops import ReduceOp, resolve_op

__all__ = ["Collectives"]

_FAST_OPS: dict[object, ReduceOp] = {**{op: op for op in ReduceOp}, **{op.value: op for op in ReduceOp}}
_MAX_DIMS = 12
_SUM = ReduceOp.SUM
_INT64 = torch.int64


class Collectives(EngineBinding):
    """The tensor collectives over one engine (``_bind``); ``comm.Communicator`` adds the rest of the API."""

    # ----------------------------------------------------------------- reductions (shared by several calls)
    def _allreduce_impl(self, x: Tensorish, op: ReduceOp | str, inplace: bool, async_: bool) -> Any:
        rop = resolve_op(op)
        if inplace:
            t, writeback = self._inplace(x)
            out, as_np = t, False
        else:
            t, as_np = self._input(x)
            writeback = None
            out = torch.empty_like(t)
        self._signature("allreduce", t, rop)
        prim = self._allreduce_async if async_ else self._allreduce
        work, post = self._reduce_with(prim, t, out, rop)

        def finish() -> Any:
            if post is not None:
                post()
            if writeback is not None:
                writeback()
            return x if inplace else self._output(out, as_np)
        if async_:
            return Handle(work, finish)
        return finish()

    # ----------------------------------------------------------------- public collectives
    def barrier(self) -> None:
        """Every rank waits here until all have arrived. On MPI, a sender whose earlier message its receiver
        refused (mismatched size) raises here, after the barrier (engines/mpi/checks.py)."""
        self._signature("barrier")
        self._barrier()
        refused = self._pending_mismatch()
        if refused is not None:
            raise refused

    def _fast_tensor(self, x: Any) -> torch.Tensor | None:
        """x as a tensor when it needs none of the general path's work (the common case, kept cheap)."""
        if type(x) is torch.Tensor:
            if x.dtype in self._fast_dtypes and x.is_contiguous() and not x.requires_grad:
                return x
        elif type(x) is np.ndarray and x.dtype in self._fast_np_dtypes and x.flags.c_contiguous \
                and x.flags.writeable:
            return torch.from_numpy(x)
        return None

    def allreduce(self, x: Array, op: ReduceOp | str = ReduceOp.SUM) -> Array:
        """Elementwise reduction over ranks, returned as a new tensor/array on every rank."""
        t = self._fast_tensor(x)
        if t is not None:
            fast_op = _FAST_OPS.get(op)
            if fast_op is not None and (fast_op is not ReduceOp.MEAN or t.dtype.is_floating_point):
                if self._due():
                    self._compare("allreduce", t, fast_op, -1, None)
                out = torch.empty_like(t)
                self._allreduce(t, out, ReduceOp.SUM if fast_op is ReduceOp.MEAN else fast_op)
                if fast_op is ReduceOp.MEAN:
                    out.div_(self._size)
                return out if type(x) is torch.Tensor else out.numpy()  # type: ignore[return-value]
        return self._allreduce_impl(x, op, False, False)  # type: ignore[no-any-return]

    def allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM) -> Array:
        """In-place allreduce; returns x."""
        if op is _SUM and type(x) is torch.Tensor and self._left > 1 and x.is_contiguous() and not x.requires_grad:
            # the commonest call, inlined: a buffer summed before goes straight to the engine with what it prepared
            # for that address (on MPI the buffer spec, ~2 us to build); the dtype was checked when it was prepared
            prepared = self._sum_of((x.data_ptr(), x.nbytes, x.dtype))
            if prepared is not None:
                self._left -= 1  # not due for the desync check (``_due``, inlined)
                self._allreduce_prepared(x, prepared, _SUM)
                return x
            if x.dtype in self._fast_dtypes:
                self._left -= 1
                prepared = self._prepared_sum(x)
                if prepared is None:
                    self._allreduce(x, x, _SUM)
                    return x
                self._plans.keep_sum(x, prepared)
                self._allreduce_prepared(x, prepared, _SUM)
                return x
        t = self._fast_tensor(x)
        if t is not None:
            fast_op = op if op is _SUM else _FAST_OPS.get(op)  # (an Enum's hash is a Python call)
            if fast_op is not None and (fast_op is not ReduceOp.MEAN or t.dtype.is_floating_point):
                engine_op = ReduceOp.SUM if fast_op is ReduceOp.MEAN else fast_op
                if self._due():
                    self._compare_overlapped("allreduce", t, fast_op, lambda: self._allreduce(t, t, engine_op))
                else:
                    self._allreduce(t, t, engine_op)
                if fast_op is ReduceOp.MEAN:
                    t.div_(self._size)
                return x
        return self._allreduce_impl(x, op, True, False)  # type: ignore[no-any-return]

    def allreduce_async(self, x: Array, op: ReduceOp | str = ReduceOp.SUM) -> Handle[Array]:
        """Start an allreduce; ``handle.wait()`` returns the result. Keep x unchanged until then."""
        return self._allreduce_impl(x, op, False, True)  # type: ignore[no-any-return]

    def allreduce_async_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM) -> Handle[Array]:
        """Start an in-place allreduce; ``handle.wait()`` returns x."""
        return self._allreduce_impl(x, op, True, True)  # type: ignore[no-any-return]

    def broadcast(self, x: Array, root: int = 0) -> Array:
        """Root's value, returned as a new tensor/array on every rank (x's shape and dtype must match root's)."""
        root = self._check_root(root)
        t, as_np = self._input(x)
        out = t.clone()
        self._signature("broadcast", out, root=root)
        self._broadcast(self._wired(out), root)
        return self._output(out, as_np)  # type: ignore[no-any-return]

    def broadcast_(self, x: Array, root: int = 0) -> Array:
        """In-place broadcast; returns x."""
        if type(x) is torch.Tensor and type(root) is int and 0 <= root < self._size and self._left > 1 \
                and x.is_contiguous() and not x.requires_grad:
            prepared = self._plans.one("broadcast", x)  # a buffer broadcast before (plans.py)
            if prepared is not None:
                self._left -= 1
                self._broadcast_prepared(x, prepared, root)
                return x
            if x.dtype in self._fast_dtypes and x.dtype not in self._wire_dtypes:
                prepared = self._prepared_buffer(x)
                if prepared is not None:
                    self._plans.keep_one("broadcast", x, prepared)
        t = self._fast_tensor(x)
        if t is None:
            return self.broadcast_async_(x, root).wait()
        root = self._check_root(root)  # the lean path, as allreduce_'s: no handle, no writeback
        if self._due():
            self._compare("broadcast", t, None, root, None)
        self._broadcast(self._wired(t), root)
        return x

    def broadcast_async_(self, x: Array, root: int = 0) -> Handle[Array]:
        """Start an in-place broadcast; ``handle.wait()`` returns x."""
        root = self._check_root(root)
        t, writeback = self._inplace(x)
        self._signature("broadcast", t, root=root)
        work = self._broadcast_async(self._wired(t), root)

        def finish() -> Array:
            if writeback is not None:
                writeback()
            return x
        return Handle(work, finish)

    def _row_meta(self, call: str, t: torch.Tensor) -> list[int]:
        """Allgather (dtype, ndim, rows, row size) so uneven first dims work and mismatches raise everywhere."""
        mine = [DTYPE_ID[t.dtype], t.dim(), t.shape[0], row_numel(t), hash(tuple(t.shape[1:])) & 0x7FFFFFFFFFFF]
        table = torch.empty(self._size * len(mine), dtype=_INT64)
        self._allgather(torch.tensor(mine, dtype=_INT64), table, [len(mine)] * self._size)
        rows = table.view(self._size, -1).tolist()
        if any(row[:2] != mine[:2] or row[3:] != mine[3:] for row in rows):
            desc = "; ".join(f"rank {i}: dtype {SUPPORTED_DTYPES[v[0]]}, ndim {v[1]}, row of {v[3]} elements"
                             for i, v in enumerate(rows))
            raise CollectiveMismatchError(
                f"{call}: ranks disagree on dtype or trailing shape (only dim 0 may differ): {desc}"
            )
        return [row[2] for row in rows]

    def _allgather_rows(self, call: str, t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        if t.dim() == 0:
            t = t.reshape(1)
        self._signature(call, t, numel=-1)
        rows = self._row_meta(call, t)
        row = row_numel(t)
        out = rows_like(t, sum(rows))
        self._allgather(self._wired(t), self._wired(out), [r * row for r in rows])
        return out, rows

    def allgather(self, x: Array, out: Array | None = None) -> Array:
        """Every rank's x concatenated along dim 0, everywhere; first dims may differ per rank.

        Args:
            x: this rank's rows.
            out: a buffer to write the result into and return, of size() times x's rows (then every rank's x
                must have the same shape, as for ``all_gather_into_tensor``; no row counts are exchanged).
        """
        if out is not None:
            hit = self._planned("allgather", x, out)
            if hit is not None:
                self._left -= 1  # not due for the desync check (``_planned`` saw to that)
                self._allgather_prepared(*hit)
                return out
        t, as_np = self._input(x)
        if out is not None:
            t, o = self._gather_into(t, out)
            self._allgather(self._wired(t), self._wired(o), [t.numel()] * self._size)
            self._keep_plan("allgather", x, out, t, o)
            return out
        gathered, _ = self._allgather_rows("allgather", t)
        return self._output(gathered, as_np)  # type: ignore[no-any-return]

    def _gather_into(self, t: torch.Tensor, out: Array) -> tuple[torch.Tensor, torch.Tensor]:
        """An allgather into the caller's ``out=`` (blocking or not): x's rows and the buffer, checked, and the call
        signed with its size, which every rank must share (no row counts are exchanged)."""
        if t.dim() == 0:
            t = t.reshape(1)
        o = out_tensor(out, t, self._size * t.shape[0], "allgather")
        self._signature("allgather", t)
        return t, o

    def allgather_async(self, x: Array, out: Array | None = None) -> Handle[Array]:
        """Start an allgather; ``wait()`` returns the result.

        Args:
            x: this rank's rows.
            out: a buffer of size() times x's rows to gather into (every rank's x the same shape): nothing is
                exchanged before the call starts. Without it the row counts are exchanged first, synchronously.
        """
        t, as_np = self._input(x)
        if out is not None:
            t, o = self._gather_into(t, out)
            work = self._allgather_async(self._wired(t), self._wired(o), [t.numel()] * self._size)
            return Handle(work, lambda: out)
        if t.dim() == 0:
            t = t.reshape(1)
        self._signature("allgather", t, numel=-1)
        rows = self._row_meta("allgather", t)
        row = row_numel(t)
        gathered = rows_like(t, sum(rows))
        work = self._allgather_async(self._wired(t), self._wired(gathered), [r * row for r in rows])
        return Handle(work, lambda: self._output(gathered, as_np))

    def reduce(self, x: Array, root: int = 0, op: ReduceOp | str = ReduceOp.SUM) -> Array | None:
        """Elementwise reduction over ranks into ``root``: a new tensor/array there, None on the other ranks (the
        engine's own reduce where it has one, so only the root receives)."""
        root = self._check_root(root)
        rop = resolve_op(op)
        t, as_np = self._input(x)
        self._signature("reduce", t, rop, root=root)
        out = torch.empty_like(t)
        work, post = self._reduce_with(self._reduce, t, out, rop, root)
        work.wait()
        if post is not None:
            post()
        return self._output(out, as_np) if self._rank == root else None  # type: ignore[no-any-return]

    def gather(self, x: Array, root: int = 0) -> Array | None:
        """Every rank's x concatenated along dim 0 at root; None on the other ranks."""
        root = self._check_root(root)
        t, as_np = self._input(x)
        if t.dim() == 0:
            t = t.reshape(1)
        self._signature("gather", t, root=root, numel=-1)
        rows = self._row_meta("gather", t)
        row = row_numel(t)
        out = rows_like(t, sum(rows)) if self._rank == root else None
        self._gather(self._wired(t), None if out is None else self._wired(out), [r * row for r in rows], root)
        return None if out is None else self._output(out, as_np)  # type: ignore[no-any-return]

    def scatter(self, x: Array | None, root: int = 0) -> Array:
        """Root's x split along dim 0 (numpy.array_split sizes); rank i gets chunk i. x is ignored off root."""
        root = self._check_root(root)
        meta = torch.zeros(4 + _MAX_DIMS, dtype=_INT64)
        t: torch.Tensor | None = None
        problem: Exception | None = None
        if self._rank == root:
            try:
                if x is None:
                    raise InvalidArgumentError("scatter: the root rank must pass the tensor to scatter, got None")
                t, as_np = self._input(x)
                if t.dim() == 0 or t.dim() > _MAX_DIMS:
                    raise InvalidArgumentError(f"scatter needs 1 to {_MAX_DIMS} dimensions, got {t.dim()}")
                meta[:4] = torch.tensor([1, DTYPE_ID[t.dtype], int(as_np), t.dim()])
                meta[4:4 + t.dim()] = torch.tensor(t.shape)
            except InvalidArgumentError as err:
                problem = err  # tell the other ranks before raising, so nobody waits for data
        self._signature("scatter", root=root)
        self._broadcast(meta, root)
        status, dtype_id, as_np_flag, ndim = meta[:4].tolist()
        if status != 1:
            if problem is not None:
                raise problem
            raise InvalidArgumentError(f"scatter: root rank {root} rejected its input (see its error)")
        shape: list[int] = meta[4:4 + ndim].tolist()
        dtype = SUPPORTED_DTYPES[dtype_id]
        rows = split_sizes(shape[0], self._size)
        row = int(np.prod(shape[1:], dtype=np.int64))
        if t is not None:
            device = t.device
        elif as_np_flag:
            device = torch.device("cpu")
        else:
            device = x.device if isinstance(x, torch.Tensor) else self._device
        out = torch.empty((rows[self._rank], *shape[1:]), dtype=dtype, device=device)
        self._scatter(None if t is None else self._wired(t), self._wired(out), [r * row for r in rows], root)
        return self._output(out, bool(as_np_flag))  # type: ignore[no-any-return]

    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM, out: Array | None = None) -> Array:
        """Reduce x over ranks, then rank i keeps chunk i of dim 0 (numpy.array_split sizes).

        Args:
            x: the full input on every rank.
            op: the reduction.
            out: a buffer for this rank's chunk, written and returned (saves an allocation per call).
        """
        if out is not None and op is _SUM:
            hit = self._planned("reduce_scatter", x, out)
            if hit is not None:
                self._left -= 1  # not due for the desync check (``_planned`` saw to that)
                self._reduce_scatter_prepared(*hit, _SUM)
                return out
            result = self._reduce_scatter_impl(x, op, self._reduce_scatter, out).wait()
            if type(x) is torch.Tensor and type(out) is torch.Tensor and x.dim() and x.shape[0] % self._size == 0:
                self._keep_plan("reduce_scatter", x, out, x, out)  # equal blocks
            return result
        return self._reduce_scatter_impl(x, op, self._reduce_scatter, out).wait()

    def reduce_scatter_async(self, x: Array, op: ReduceOp | str = ReduceOp.SUM) -> Handle[Array]:
        """Start a reduce_scatter; ``wait()`` returns this rank's chunk (for overlap with backward)."""
        return self._reduce_scatter_impl(x, op, self._reduce_scatter_async)

    def _reduce_scatter_impl(self, x: Array, op: ReduceOp | str, prim: Callable[..., Work | None],
                             given: Array | None = None) -> Handle[Array]:
        rop = resolve_op(op)
        t, as_np = self._input(x)
        if t.dim() == 0:
            raise InvalidArgumentError("reduce_scatter needs at least one dimension to split")
        rows = split_sizes(t.shape[0], self._size)
        out = rows_like(t, rows[self._rank]) if given is None else out_tensor(given, t, rows[self._rank],
                                                                               "reduce_scatter")
        self._signature("reduce_scatter", t, rop)
        row = row_numel(t)
        work, post = self._reduce_with(prim, t, out, rop, [r * row for r in rows])

        def finish() -> Array:
            if post is not None:
                post()
            return given if given is not None else self._output(out, as_np)  # type: ignore[no-any-return]
        return Handle(work, finish)

    def alltoall(self, x: Array, splits: Sequence[int] | None = None, out: Array | None = None) -> Array:
        """Send ``splits[i]`` rows of x (dim 0, in order) to rank i; returns what every rank sent here,
        concatenated in rank order. Default splits: numpy.array_split sizes.

        Args:
            x: the rows to send.
            splits: rows for each rank.
            out: with the default splits, a buffer of x's shape for the result, written and returned: every
                rank then sends x.shape[0] / size() rows to each (``all_to_all_single``'s even case) and no row
                counts are exchanged.
        """
        if out is None:
            return self.alltoall_splits(x, splits)[0]
        if splits is None:
            hit = self._planned("alltoall", x, out)
            if hit is not None:
                self._left -= 1  # not due for the desync check (``_planned`` saw to that)
                self._alltoall_prepared(*hit)
                return out
        t, _ = self._input(x)
        if t.dim() == 0:
            raise InvalidArgumentError("alltoall needs at least one dimension to split")
        n = t.shape[0]
        if splits is not None or n % self._size:
            raise InvalidArgumentError(f"alltoall(out=...) needs the default splits and x.shape[0]={n} "
                                       f"divisible by size()={self._size}; pass splits without out instead")
        o = out_tensor(out, t, n, "alltoall")
        self._signature("alltoall", t)  # sizes compared too: they must be equal
        counts = [t.numel() // self._size] * self._size
        self._alltoall(self._wired(t), self._wired(o), counts, counts)
        self._keep_plan("alltoall", x, out, t, o)
        return out

    def alltoall_splits(self, x: Array, splits: Sequence[int] | None = None) -> tuple[Array, list[int]]:
        """``alltoall(x, splits)`` and the rows each rank sent here (Horovod's received splits): the row counts
        travel in any case, so this costs nothing more.

        Args:
            x: the rows to send.
            splits: rows for each rank (default: numpy.array_split sizes).
        """
        t, as_np = self._input(x)
        if t.dim() == 0:
            raise InvalidArgumentError("alltoall needs at least one dimension to split")
        n = t.shape[0]
        if splits is None:
            send_rows = split_sizes(n, self._size)
        else:
            send_rows = [int(s) for s in splits]
            if len(send_rows) != self._size or any(s < 0 for s in send_rows) or sum(send_rows) != n:
                raise InvalidArgumentError(
                    f"alltoall splits {list(splits)} must be {self._size} non-negative row counts summing to "
                    f"x.shape[0]={n}"
                )
        self._signature("alltoall", t, numel=-1)
        ones = [1] * self._size
        recv_rows_t = torch.empty(self._size, dtype=_INT64)
        self._alltoall(torch.tensor(send_rows, dtype=_INT64), recv_rows_t, ones, ones)
        recv_rows = recv_rows_t.tolist()
        row = row_numel(t)
        got = rows_like(t, sum(recv_rows))
        self._alltoall(self._wired(t), self._wired(got), [r * row for r in send_rows], [r * row for r in recv_rows])
        return self._output(got, as_np), recv_rows
