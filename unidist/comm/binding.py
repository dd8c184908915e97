"""What every collective stands on: a communicator's hold on its engine.

``EngineBinding`` keeps the engine's primitives as bound methods read once (``_bind``), the fast path's native
dtypes and the engine's prepared arguments by buffer (plans.py), tensor/numpy conversion, rank checks, and the
countdown to the next desync check, whose state is the ``DesyncCheck`` it holds (check.py). The calls
themselves are ``Collectives``' (collectives.py) and ``Communicator``'s (communicator.py)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from unidist.comm import check
from unidist.comm.dtypes import SUPPORTED_DTYPES, inplace_tensor, output, to_tensor
from unidist.comm.engine import Engine
from unidist.comm.plans import Plans
from unidist.comm.primitives import PRIMITIVES
from unidist.comm.reduction import reduce_with
from unidist.comm.work import Work
from unidist.config import Config
from unidist.ops import ReduceOp

__all__ = ["EngineBinding"]


class EngineBinding(abc.ABC):
    """A communicator's hold on one engine (``_bind``): what ``Collectives`` and ``Communicator`` are written on."""

    config: Config
    _device: torch.device
    _rank: int
    _size: int
    # the engine's primitives as bound methods, ``_<name>`` for every one comm/primitives.py declares (``_bind`` sets
    # them from the declaration; test_primitives checks that each has its type here)
    _barrier: Callable[[], None]
    _broadcast: Callable[[torch.Tensor, int], None]
    _allreduce: Callable[[torch.Tensor, torch.Tensor, ReduceOp], None]
    _allgather: Callable[[torch.Tensor, torch.Tensor, Sequence[int]], None]
    _gather: Callable[[torch.Tensor, torch.Tensor | None, Sequence[int], int], None]
    _scatter: Callable[[torch.Tensor | None, torch.Tensor, Sequence[int], int], None]
    _reduce_scatter: Callable[[torch.Tensor, torch.Tensor, Sequence[int], ReduceOp], None]
    _alltoall: Callable[[torch.Tensor, torch.Tensor, Sequence[int], Sequence[int]], None]
    _send: Callable[[torch.Tensor, int, int], None]
    _recv: Callable[[torch.Tensor, int, int], None]
    _reduce: Callable[[torch.Tensor, torch.Tensor, int, ReduceOp], None]
    _grouped_allreduce: Callable[[Sequence[Any], ReduceOp, bool], list[Any] | None]
    _allreduce_prepared: Callable[[torch.Tensor, Any, ReduceOp], None]
    _broadcast_prepared: Callable[[torch.Tensor, Any, int], None]
    _allgather_prepared: Callable[[torch.Tensor, torch.Tensor, Any], None]
    _alltoall_prepared: Callable[[torch.Tensor, torch.Tensor, Any], None]
    _reduce_scatter_prepared: Callable[[torch.Tensor, torch.Tensor, Any, ReduceOp], None]
    _allreduce_async: Callable[[torch.Tensor, torch.Tensor, ReduceOp], Work]
    _reduce_scatter_async: Callable[[torch.Tensor, torch.Tensor, Sequence[int], ReduceOp], Work]
    _broadcast_async: Callable[[torch.Tensor, int], Work]
    _allgather_async: Callable[[torch.Tensor, torch.Tensor, Sequence[int]], Work]
    _check_exchange: Callable[..., None]

    def _init_collectives(self) -> None:
        # the desync check (check.py) owns its mode, K, call count and cost; this communicator keeps its own copy of
        # two of them for its hot paths, refreshed after every check and reset: the calls until the next check
        # (``_due``, inlined in allreduce_), and whether every call is checked (UNIDIST_CHECK_COLLECTIVES=1)
        self._desync = check.DesyncCheck()
        self._left = check.NEVER
        self._checked = False
        self._fast_dtypes: frozenset[torch.dtype] = frozenset()  # filled by _enable_fast_path: see allreduce
        self._fast_np_dtypes: frozenset[np.dtype[Any]] = frozenset()
        self._plans = Plans()  # the engine's prepared arguments by buffer (plans.py)
        self._sum_of = self._plans.sums.get  # its in-place sums by (address, bytes, dtype): one lookup, inlined

    def _bind(self, engine: Engine) -> None:
        """Hold ``engine`` and keep its primitives as bound methods, read once here: the hot calls then cost no
        more than a method of this class would (``self._engine.allreduce`` is one attribute read more per call,
        a tenth of an 8-byte in-place allreduce's own overhead)."""
        self._engine = engine
        self._rank, self._size = engine.rank, engine.size
        self._upcast_reduce, self._wire_dtypes = engine.upcast_reduce, engine.wire_dtypes
        for primitive in PRIMITIVES:  # every declared primitive (comm/primitives.py), as the engine gives it
            setattr(self, "_" + primitive.name, getattr(engine, primitive.name))
        self._desync.bind(engine)
        self._prepared_sum, self._prepared_blocks = engine.prepared_sum, engine.prepared_blocks
        self._prepared_buffer = engine.prepared_buffer
        self._plans.clear()
        self._pending_mismatch = engine.pending_mismatch

    def _enable_fast_path(self) -> None:
        """The lean allreduce path for the common case (native dtype, contiguous)."""
        self.restart_desync_check()
        native = [d for d in SUPPORTED_DTYPES if d not in self._upcast_reduce and d is not torch.bool]
        self._fast_dtypes = frozenset(native)
        self._fast_np_dtypes = frozenset(np.dtype(str(d).replace("torch.", "")) for d in native
                                         if d is not torch.bfloat16)

    def _disable_fast_path(self) -> None:
        self._fast_dtypes = frozenset()
        self._plans.clear()

    def _planned(self, call: str, x: Any, out: Any) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """(x, out, the engine's prepared arguments) for an ``out=`` call on buffers checked before and not due for
        the desync check (plans.py says why), or None: then the checked path."""
        return None if self._left <= 1 else self._plans.blocks_of(call, x, out)

    def _keep_plan(self, call: str, x: Any, out: Any, t: torch.Tensor, o: torch.Tensor) -> None:
        """After a checked ``out=`` call that gave the engine ``x`` and ``out`` themselves (``t``, ``o``), keep the
        engine's prepared arguments for that pair, where it has any."""
        if t is not x or o is not out or t.dtype not in self._fast_dtypes or t.dtype in self._wire_dtypes \
                or not t.is_contiguous() or not o.is_contiguous():
            return
        prepared = self._prepared_blocks(t, o)
        if prepared is not None:
            self._plans.keep_blocks(call, t, o, prepared)

    @abc.abstractmethod
    def _need_started(self) -> None:
        """Raise NotInitializedError unless the engine behind this communicator is running."""

    def _wired(self, t: torch.Tensor) -> torch.Tensor:
        wire = self._wire_dtypes.get(t.dtype)
        return t if wire is None else t.view(wire)

    # ----------------------------------------------------------------- input/output conversion
    _input = staticmethod(to_tensor)
    _inplace = staticmethod(inplace_tensor)
    _output = staticmethod(output)

    def _check_root(self, root: int, what: str = "root") -> int:
        self._need_started()
        return check.check_rank(root, self._size, what)

    # ----------------------------------------------------------------- desync detection
    def _due(self) -> bool:
        """Whether this collective is compared across ranks (check.py): every one with UNIDIST_CHECK_COLLECTIVES=1,
        one in K by default. Every collective calls this (or its inlined form) exactly once: the ranks count
        alike."""
        left = self._left - 1
        if left > 0:
            self._left = left
            return False
        return True

    def _signature(self, call: str, t: torch.Tensor | None = None, op: ReduceOp | None = None,
                   root: int = -1, numel: int | None = None) -> None:
        """When the call is due (``_due``), every rank compares what it is about to call (see check.py)."""
        self._need_started()
        if self._due():
            self._compare(call, t, op, root, numel)

    def _compare(self, call: str, t: torch.Tensor | None, op: ReduceOp | None, root: int, numel: int | None) -> None:
        """The due call compared across ranks (``DesyncCheck.signature``); the countdown then restarts at the
        distance the ranks agreed on (still 1 if the check failed before they agreed)."""
        try:
            self._desync.signature(call, t, op, root, numel)
        finally:
            self._left = self._desync.countdown

    def _compare_overlapped(self, call: str, t: torch.Tensor, op: ReduceOp, run: Callable[[], None]) -> None:
        """``_compare`` for an allreduce of equal-sized buffers, made by ``run`` beside the check where the engine
        can (``DesyncCheck.overlapped``)."""
        try:
            self._desync.overlapped(call, t, op, run)
        finally:
            self._left = self._desync.countdown

    @property
    def desync_check(self) -> check.DesyncCheck:
        """This communicator's desync check (check.py): its mode, the distance K between checks the ranks agreed
        on, and what the last check cost; ``restart_desync_check`` starts it over."""
        return self._desync

    def restart_desync_check(self, every: int | None = None, cost: float = 0.0) -> None:
        """Read ``config.check_collectives`` again and start the desync check over: the next call is checked, or,
        in the default mode (one in K) with ``every``, K = ``every`` with a last check of ``cost`` s (a benchmark
        resuming the K that ``desync_check.every`` said). The ranks must agree: every rank restarts at the same
        point of its calls, with the same ``every``.

        Args:
            every: the calls to the next check, and K until the ranks agree on another (default mode only).
            cost: the seconds the last check took, from which K adapts.
        """
        self._desync.reset(self.config.check_collectives)
        if every is not None:
            self._desync.set_every(every, cost)
        self._left, self._checked = self._desync.countdown, self._desync.every_call

    # ----------------------------------------------------------------- reductions (shared by several calls)
    def _reduce_with(self, prim: Callable[..., Work | None], send: torch.Tensor, recv: torch.Tensor,
                     op: ReduceOp, *extra: Any) -> tuple[Work, Callable[[], None] | None]:
        """``reduction.reduce_with`` on this communicator's size and the engine's native dtypes."""
        return reduce_with(prim, send, recv, op, self._size, self._upcast_reduce, *extra)
