"""The Manager contract, written once.

A backend implements a handful of primitives on contiguous torch tensors (``_allreduce``, ``_broadcast``,
``_allgather``, ``_alltoall``, ``_send``/``_recv``, ``_barrier``, lifecycle). Everything a user calls —
numpy/torch conversion, in-place variants, ``mean``, bool and half-precision handling, uneven sizes,
grouped and object collectives, argument checks, desync detection — lives here so that every backend
behaves the same.
"""

from __future__ import annotations

import abc
import logging
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar

import numpy as np
import torch

from unidist.config import Config
from unidist.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InvalidArgumentError,
    NotInitializedError,
    UnidistError,
)
from unidist.launch import LaunchInfo, detect
from unidist.ops import ReduceOp, resolve_op

if TYPE_CHECKING:
    from unidist.optim.options import TrainOptions

__all__ = ["EngineWork", "Handle", "Manager", "Work", "get_manager", "split_sizes"]

_log = logging.getLogger("unidist")
_active: Manager | None = None

Array = TypeVar("Array", torch.Tensor, np.ndarray)
Tensorish = torch.Tensor | np.ndarray

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
)
_DTYPE_ID = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_NP_DTYPES = frozenset(np.dtype(n) for n in ("float16", "float32", "float64", "int8", "int16", "int32",
                                              "int64", "uint8", "bool"))
# On 0/1 bytes, max is logical or and min logical and: numpy's meaning of + and * on bool arrays.
_BOOL_OP = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX,
            ReduceOp.PRODUCT: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN}
_OP_ID = {op: i for i, op in enumerate(ReduceOp)}
_FAST_OPS: dict[object, ReduceOp] = {**{op: op for op in ReduceOp}, **{op.value: op for op in ReduceOp}}
_MAX_DIMS = 12
_INT64 = torch.int64


def get_manager() -> Manager:
    """The started Manager of this process."""
    if _active is None:
        raise NotInitializedError("no unidist Manager is active; start one with `with unidist.init() as mgr:`")
    return _active


def split_sizes(n: int, parts: int) -> list[int]:
    """numpy.array_split's sizes: the first ``n % parts`` parts get one extra row."""
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


class Work(Protocol):
    """An engine's in-flight operation."""

    def wait(self) -> None: ...
    def test(self) -> bool: ...


class _Done:
    __slots__ = ()

    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


DONE: Work = _Done()


class EngineWork:
    """An engine's in-flight request as a Work; holds the buffers so they outlive the operation."""

    __slots__ = ("_keep", "_test", "_wait")

    def __init__(self, wait: Callable[[], object], test: Callable[[], object], *keep: object) -> None:
        self._wait, self._test, self._keep = wait, test, keep

    def wait(self) -> None:
        self._wait()

    def test(self) -> bool:
        return bool(self._test())


class Handle(Generic[Array]):
    """Result of an ``*_async`` call: ``wait()`` completes it and returns the result."""

    __slots__ = ("_finish", "_result", "_work")

    def __init__(self, work: Work, finish: Callable[[], Array]) -> None:
        self._work: Work | None = work
        self._finish: Callable[[], Array] = finish
        self._result: Array | None = None

    def done(self) -> bool:
        """True once the operation finished (``wait`` then returns at once)."""
        return self._work is None or self._work.test()

    def wait(self) -> Array:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._result = self._finish()
        return self._result  # type: ignore[return-value]


_OBJ_NAMES = ("barrier", "broadcast", "allreduce", "allgather", "gather", "scatter", "reduce_scatter",
              "alltoall", "send", "recv")
_CALL_ID = {n: i for i, n in enumerate(_OBJ_NAMES)}


class Manager(abc.ABC):
    """One distributed run. ``with Manager() as mgr:`` starts the engine and always shuts it down."""

    name: ClassVar[str] = "base"
    # dtypes the engine cannot reduce natively -> the wider dtype they are reduced in (then cast back once)
    _upcast_reduce: ClassVar[Mapping[torch.dtype, torch.dtype]] = {}
    # dtypes the engine cannot move -> a same-size dtype whose bits it moves unchanged (no arithmetic)
    _wire_dtypes: ClassVar[Mapping[torch.dtype, torch.dtype]] = {}

    def _wired(self, t: torch.Tensor) -> torch.Tensor:
        wire = self._wire_dtypes.get(t.dtype)
        return t if wire is None else t.view(wire)

    def __init__(self, config: Config | None = None, launch: LaunchInfo | None = None) -> None:
        self.config = config if config is not None else Config.from_env()
        self.launch = launch if launch is not None else detect()
        self._started = False
        self._rank = self._size = self._local_rank = self._local_size = self._node_rank = -1
        self._device = torch.device("cpu")
        self._saved_env: dict[str, str | None] = {}
        self._seq = 0
        self._failing = False  # set by __exit__ when an exception is leaving the with block
        self._fast_dtypes: frozenset[torch.dtype] = frozenset()  # filled at start: see allreduce
        self._fast_np_dtypes: frozenset[np.dtype[Any]] = frozenset()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Manager:
        """Start the engine; ``with`` does this for you. A Manager starts once."""
        global _active
        if self._started:
            raise UnidistError(f"{type(self).__name__} is already started; start it once (one `with` block)")
        if _active is not None:
            raise UnidistError(
                f"another Manager ({type(_active).__name__}) is active in this process; shut it down first"
            )
        logging.getLogger("unidist").setLevel(self.config.log_level)
        try:
            self._start()
            self._device = self._pick_device()
        except BaseException:
            self._restore_env()
            raise
        self._started = True
        _active = self
        if not (self.config.check_collectives and self._size > 1):  # the fast path skips the signature check
            native = [d for d in SUPPORTED_DTYPES if d not in self._upcast_reduce and d is not torch.bool]
            self._fast_dtypes = frozenset(native)
            self._fast_np_dtypes = frozenset(np.dtype(str(d).replace("torch.", "")) for d in native
                                             if d is not torch.bfloat16)
        _log.info("%s started: rank %d of %d on %s", type(self).__name__, self._rank, self._size, self._device)
        return self

    def shutdown(self) -> None:
        """Shut the engine down and undo what ``start`` changed; safe to call twice."""
        global _active
        if not self._started:
            return
        try:
            self._shutdown()
        finally:
            self._started = False
            self._fast_dtypes = frozenset()
            self._fast_np_dtypes = frozenset()
            if _active is self:
                _active = None
            self._restore_env()

    def __enter__(self) -> Manager:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        try:
            failed = exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))
            self._failing = failed
            if failed and self._started and self._size > 1:
                self._abort_job(exc)  # type: ignore[arg-type]
        finally:
            self.shutdown()
        return False

    def _abort_job(self, exc: BaseException) -> None:  # noqa: B027 - optional hook, a no-op by default
        """One rank failed while the others may wait in a collective; backends that can, end the job."""

    def _report_failure(self, exc: BaseException) -> None:
        print(f"unidist: rank {self._rank} of {self._size} failed; ending the job so the other ranks do not "
              "wait forever:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        sys.stderr.flush()

    def _setenv(self, name: str, value: str) -> None:
        """Set an environment variable for the engine; restored at shutdown."""
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def _restore_env(self) -> None:
        for name, old in self._saved_env.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        self._saved_env.clear()

    def _pick_device(self) -> torch.device:
        want = self.config.device
        if want == "cpu":
            return torch.device("cpu")
        if want.startswith("cuda:"):
            return torch.device(want)
        if torch.cuda.is_available():
            return torch.device(f"cuda:{self._local_rank % torch.cuda.device_count()}")
        if want == "cuda":
            from unidist.errors import ConfigError

            raise ConfigError("UNIDIST_DEVICE='cuda' but torch sees no CUDA device; unset it or use 'cpu'")
        return torch.device("cpu")

    # ----------------------------------------------------------------- topology
    def _need_started(self) -> None:
        if not self._started:
            raise NotInitializedError(
                f"{type(self).__name__} is not started; use `with unidist.init() as mgr:` or call mgr.start()"
            )

    @property
    def started(self) -> bool:
        return self._started

    @property
    def rank(self) -> int:
        self._need_started()
        return self._rank

    @property
    def size(self) -> int:
        self._need_started()
        return self._size

    @property
    def local_rank(self) -> int:
        self._need_started()
        return self._local_rank

    @property
    def local_size(self) -> int:
        self._need_started()
        return self._local_size

    @property
    def node_rank(self) -> int:
        self._need_started()
        return self._node_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return self.name

    @property
    def device(self) -> torch.device:
        self._need_started()
        return self._device

    def __repr__(self) -> str:
        if not self._started:
            return f"<{type(self).__name__} not started>"
        return f"<{type(self).__name__} rank {self._rank}/{self._size} local {self._local_rank}/" \
               f"{self._local_size} node {self._node_rank} device {self._device}>"

    # ----------------------------------------------------------------- backend primitives
    @abc.abstractmethod
    def _start(self) -> None:
        """Initialise the engine and set _rank, _size, _local_rank, _local_size, _node_rank."""

    @abc.abstractmethod
    def _shutdown(self) -> None: ...

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        """In place on a contiguous tensor."""

    @abc.abstractmethod
    def _allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        """``send is recv`` means in place. op is SUM, MIN, MAX or PRODUCT on a natively reducible dtype."""

    @abc.abstractmethod
    def _allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        """recv (flat, contiguous) gets every rank's send; counts are element counts per rank."""

    @abc.abstractmethod
    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        """Element counts per peer; chunks laid out in rank order in both buffers."""

    @abc.abstractmethod
    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None: ...

    @abc.abstractmethod
    def _recv(self, t: torch.Tensor, source: int, tag: int) -> None: ...

    # Derived primitives: correct on every backend, overridden where the engine has a native call.
    def _gather(self, send: torch.Tensor, recv: torch.Tensor | None, counts: Sequence[int], root: int) -> None:
        zeros = [0] * self._size
        send_counts = list(zeros)
        send_counts[root] = send.numel()
        recv_counts = list(counts) if self._rank == root else zeros
        out = recv if recv is not None else send.new_empty(0)
        self._alltoall(send, out, send_counts, recv_counts)

    def _scatter(self, send: torch.Tensor | None, recv: torch.Tensor, counts: Sequence[int], root: int) -> None:
        zeros = [0] * self._size
        recv_counts = list(zeros)
        recv_counts[root] = recv.numel()
        src = send if send is not None else recv.new_empty(0)
        self._alltoall(src, recv, list(counts) if self._rank == root else zeros, recv_counts)

    def _reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                        op: ReduceOp) -> None:
        full = torch.empty_like(send)
        self._allreduce(send, full, op)
        start = sum(counts[: self._rank])
        recv.view(-1).copy_(full.view(-1)[start:start + recv.numel()])

    def _allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        self._allreduce(send, recv, op)
        return DONE

    def _broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        self._broadcast(t, root)
        return DONE

    def _allgather_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Work:
        self._allgather(send, recv, counts)
        return DONE

    # ----------------------------------------------------------------- input/output conversion
    @staticmethod
    def _input(x: Tensorish) -> tuple[torch.Tensor, bool]:
        """A contiguous tensor that may share x's memory (read-only use), and whether x was numpy."""
        if isinstance(x, torch.Tensor):
            if x.dtype not in _DTYPE_ID:
                raise _bad_dtype(x.dtype)
            if x.requires_grad:
                x = x.detach()
            return (x if x.is_contiguous() else x.contiguous()), False
        if isinstance(x, np.ndarray):
            if x.dtype not in _NP_DTYPES:
                raise _bad_dtype(x.dtype)
            if not (x.flags.c_contiguous and x.flags.writeable):
                x = np.ascontiguousarray(x) if x.flags.writeable else np.array(x, order="C")
            return torch.from_numpy(x), True
        raise InvalidArgumentError(
            f"collectives take a torch.Tensor or a numpy.ndarray, got {type(x).__name__}; "
            "use broadcast_object/allgather_object for other Python objects"
        )

    @staticmethod
    def _inplace(x: Tensorish) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """A contiguous tensor over x's memory when possible, else a copy plus a write-back."""
        if isinstance(x, np.ndarray):
            if not x.flags.writeable:
                raise InvalidArgumentError("in-place collective on a read-only numpy array; pass a writable one")
            if x.dtype not in _NP_DTYPES:
                raise _bad_dtype(x.dtype)
            if x.flags.c_contiguous:
                return torch.from_numpy(x), None
            tmp = torch.from_numpy(np.ascontiguousarray(x))
            return tmp, lambda: np.copyto(x, tmp.numpy())
        if isinstance(x, torch.Tensor):
            if x.dtype not in _DTYPE_ID:
                raise _bad_dtype(x.dtype)
            t = x.detach() if x.requires_grad else x
            if t.is_contiguous():
                return t, None
            tmp = t.contiguous()

            def writeback() -> None:
                t.copy_(tmp)
            return tmp, writeback
        raise InvalidArgumentError(f"in-place collectives take a torch.Tensor or a numpy.ndarray, "
                                   f"got {type(x).__name__}")

    @staticmethod
    def _output(t: torch.Tensor, as_numpy: bool) -> Any:
        return t.numpy() if as_numpy else t

    def _check_root(self, root: int, what: str = "root") -> int:
        self._need_started()
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self._size:
            raise InvalidArgumentError(f"{what}={root!r} is not a rank of this world (0..{self._size - 1})")
        return root

    # ----------------------------------------------------------------- desync detection
    def _signature(self, call: str, t: torch.Tensor | None = None, op: ReduceOp | None = None,
                   root: int = -1, numel: int | None = None) -> None:
        """With UNIDIST_CHECK_COLLECTIVES, every rank compares what it is about to call; -1 matches anything."""
        self._need_started()
        if not self.config.check_collectives or self._size == 1:
            return
        self._seq += 1
        dtype_id = _DTYPE_ID.get(t.dtype, -1) if t is not None else -1
        n = numel if numel is not None else (t.numel() if t is not None else -1)
        sig = torch.tensor([self._seq, _CALL_ID[call], _OP_ID[op] if op else -1, dtype_id, n, root], dtype=_INT64)
        table = torch.empty(self._size * sig.numel(), dtype=_INT64)
        self._wait(self._allgather_async(sig, table, [sig.numel()] * self._size), call)
        rows = table.view(self._size, -1).tolist()
        first = rows[0]
        for row in rows[1:]:
            if any(a != b and a != -1 and b != -1 for a, b in zip(row, first, strict=True)):
                calls = "; ".join(f"rank {r} called {_describe(v)}" for r, v in enumerate(rows))
                raise CollectiveMismatchError(
                    f"collective #{self._seq} does not match across ranks: {calls}. Every rank must make the "
                    "same collective calls, with matching dtypes, sizes, ops and roots, in the same order."
                )

    def _wait(self, work: Work, call: str) -> None:
        deadline = time.monotonic() + self.config.timeout
        delay = 1e-5
        while not work.test():
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"rank {self._rank} waited {self.config.timeout:g} s in {call} (collective #{self._seq}) and "
                    "not every rank joined: one rank is behind, stuck or took another code path. Raise "
                    "UNIDIST_TIMEOUT if the wait is legitimate."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        work.wait()

    # ----------------------------------------------------------------- reductions (shared by several calls)
    def _reduce_with(self, prim: Callable[..., Work | None], send: torch.Tensor, recv: torch.Tensor,
                     op: ReduceOp, *extra: Any) -> tuple[Work, Callable[[], None] | None]:
        """Map op and dtype to what engines reduce natively, call ``prim(send, recv, *extra, op)``."""
        dtype = send.dtype
        mean = op is ReduceOp.MEAN
        if mean:
            if not dtype.is_floating_point:
                raise InvalidArgumentError(
                    f"op='mean' needs a floating-point tensor, got {dtype}; use op='sum' and divide, or cast first"
                )
            op = ReduceOp.SUM
        size = self._size
        if dtype is torch.bool:  # reduce 0/1 bytes: max is or, min is and
            in_place = send is recv
            send = send.view(torch.uint8)
            recv = send if in_place else recv.view(torch.uint8)
            op, dtype = _BOOL_OP[op], torch.uint8
        wide_dtype = self._upcast_reduce.get(dtype)
        if wide_dtype is not None:
            wide = send.to(wide_dtype)
            wide_out = wide if send is recv else torch.empty(recv.shape, dtype=wide_dtype, device=recv.device)
            work = prim(wide, wide_out, *extra, op)

            def narrow() -> None:
                if mean and size > 1:
                    wide_out.div_(size)
                recv.copy_(wide_out)
            return work or DONE, narrow
        work = prim(send, recv, *extra, op)
        if mean and size > 1:
            def divide() -> None:
                recv.div_(size)
            return work or DONE, divide
        return work or DONE, None

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
        """Every rank waits here until all have arrived."""
        self._signature("barrier")
        self._barrier()

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
                out = torch.empty_like(t)
                self._allreduce(t, out, ReduceOp.SUM if fast_op is ReduceOp.MEAN else fast_op)
                if fast_op is ReduceOp.MEAN:
                    out.div_(self._size)
                return out if type(x) is torch.Tensor else out.numpy()  # type: ignore[return-value]
        return self._allreduce_impl(x, op, False, False)  # type: ignore[no-any-return]

    def allreduce_(self, x: Array, op: ReduceOp | str = ReduceOp.SUM) -> Array:
        """In-place allreduce; returns x."""
        t = self._fast_tensor(x)
        if t is not None:
            fast_op = _FAST_OPS.get(op)
            if fast_op is not None and (fast_op is not ReduceOp.MEAN or t.dtype.is_floating_point):
                self._allreduce(t, t, ReduceOp.SUM if fast_op is ReduceOp.MEAN else fast_op)
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

    def grouped_allreduce(self, xs: Sequence[Array], op: ReduceOp | str = ReduceOp.SUM) -> list[Array]:
        """Allreduce many tensors in one exchange per dtype (fused into a flat buffer)."""
        return self._grouped(xs, op, inplace=False)

    def grouped_allreduce_(self, xs: Sequence[Array], op: ReduceOp | str = ReduceOp.SUM) -> list[Array]:
        """In-place grouped allreduce; returns the inputs."""
        return self._grouped(xs, op, inplace=True)

    def _grouped(self, xs: Sequence[Array], op: ReduceOp | str, inplace: bool) -> list[Any]:
        rop = resolve_op(op)
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

    def broadcast(self, x: Array, root: int = 0) -> Array:
        """Root's value, returned as a new tensor/array on every rank (x's shape and dtype must match root's)."""
        self._check_root(root)
        t, as_np = self._input(x)
        out = t.clone()
        self._signature("broadcast", out, root=root)
        self._broadcast(self._wired(out), root)
        return self._output(out, as_np)  # type: ignore[no-any-return]

    def broadcast_(self, x: Array, root: int = 0) -> Array:
        """In-place broadcast; returns x."""
        return self.broadcast_async_(x, root).wait()

    def broadcast_async_(self, x: Array, root: int = 0) -> Handle[Array]:
        """Start an in-place broadcast; ``handle.wait()`` returns x."""
        self._check_root(root)
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
        mine = [_DTYPE_ID[t.dtype], t.dim(), t.shape[0], _row_numel(t), hash(tuple(t.shape[1:])) & 0x7FFFFFFFFFFF]
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
        row = _row_numel(t)
        out = _rows_like(t, sum(rows))
        self._allgather(self._wired(t), self._wired(out), [r * row for r in rows])
        return out, rows

    def allgather(self, x: Array) -> Array:
        """Every rank's x concatenated along dim 0, everywhere; first dims may differ per rank."""
        t, as_np = self._input(x)
        out, _ = self._allgather_rows("allgather", t)
        return self._output(out, as_np)  # type: ignore[no-any-return]

    def allgather_async(self, x: Array) -> Handle[Array]:
        """Start an allgather (sizes are exchanged first, synchronously); ``wait()`` returns the result."""
        t, as_np = self._input(x)
        if t.dim() == 0:
            t = t.reshape(1)
        self._signature("allgather", t, numel=-1)
        rows = self._row_meta("allgather", t)
        row = _row_numel(t)
        out = _rows_like(t, sum(rows))
        work = self._allgather_async(self._wired(t), self._wired(out), [r * row for r in rows])
        return Handle(work, lambda: self._output(out, as_np))

    def gather(self, x: Array, root: int = 0) -> Array | None:
        """Every rank's x concatenated along dim 0 at root; None on the other ranks."""
        self._check_root(root)
        t, as_np = self._input(x)
        if t.dim() == 0:
            t = t.reshape(1)
        self._signature("gather", t, root=root, numel=-1)
        rows = self._row_meta("gather", t)
        row = _row_numel(t)
        out = _rows_like(t, sum(rows)) if self._rank == root else None
        self._gather(self._wired(t), None if out is None else self._wired(out), [r * row for r in rows], root)
        return None if out is None else self._output(out, as_np)  # type: ignore[no-any-return]

    def scatter(self, x: Array | None, root: int = 0) -> Array:
        """Root's x split along dim 0 (numpy.array_split sizes); rank i gets chunk i. x is ignored off root."""
        self._check_root(root)
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
                meta[:4] = torch.tensor([1, _DTYPE_ID[t.dtype], int(as_np), t.dim()])
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

    def reduce_scatter(self, x: Array, op: ReduceOp | str = ReduceOp.SUM) -> Array:
        """Reduce x over ranks, then rank i keeps chunk i of dim 0 (numpy.array_split sizes)."""
        rop = resolve_op(op)
        t, as_np = self._input(x)
        if t.dim() == 0:
            raise InvalidArgumentError("reduce_scatter needs at least one dimension to split")
        self._signature("reduce_scatter", t, rop)
        rows = split_sizes(t.shape[0], self._size)
        row = _row_numel(t)
        out = _rows_like(t, rows[self._rank])
        work, post = self._reduce_with(self._reduce_scatter, t, out, rop, [r * row for r in rows])
        work.wait()
        if post is not None:
            post()
        return self._output(out, as_np)  # type: ignore[no-any-return]

    def alltoall(self, x: Array, splits: Sequence[int] | None = None) -> Array:
        """Send ``splits[i]`` rows of x (dim 0, in order) to rank i; returns what every rank sent here,
        concatenated in rank order. Default splits: numpy.array_split sizes."""
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
        row = _row_numel(t)
        out = _rows_like(t, sum(recv_rows))
        self._alltoall(self._wired(t), self._wired(out), [r * row for r in send_rows], [r * row for r in recv_rows])
        return self._output(out, as_np)  # type: ignore[no-any-return]

    def send(self, x: Tensorish, dest: int, tag: int = 0) -> None:
        """Blocking send to ``dest``; the receiver calls ``recv`` with a buffer of the same shape and dtype."""
        self._check_root(dest, "dest")
        t, _ = self._input(x)
        self._send(self._wired(t), dest, _check_tag(tag))

    def recv(self, x: Array, source: int, tag: int = 0) -> Array:
        """Receive into x (in place) from ``source``; returns x."""
        self._check_root(source, "source")
        t, writeback = self._inplace(x)
        self._recv(self._wired(t), source, _check_tag(tag))
        if writeback is not None:
            writeback()
        return x

    # ----------------------------------------------------------------- training (same calls on every backend)
    def broadcast_parameters(self, model_or_state: torch.nn.Module | Mapping[str, torch.Tensor]
                             | Iterable[tuple[str, torch.Tensor]], root: int = 0) -> None:
        """Root's parameters and buffers, in place, everywhere: one fused broadcast per dtype."""
        self._check_root(root)
        if isinstance(model_or_state, torch.nn.Module):
            tensors = list(model_or_state.state_dict().values())
        elif isinstance(model_or_state, Mapping):
            tensors = list(model_or_state.values())
        else:
            tensors = [t for _, t in model_or_state]
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for ts in groups.values():
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                self.broadcast_(flat, root)
                offset = 0
                for t in ts:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def broadcast_optimizer_state(self, optimizer: Any, root: int = 0) -> None:
        """Root's optimizer state (tensors and Python scalars such as Adam's step) loaded everywhere."""
        self._check_root(root)
        inner = getattr(optimizer, "optimizer", optimizer)
        state = inner.state_dict() if self._rank == root else None
        tensors: list[torch.Tensor] = []

        def strip(obj: Any) -> Any:  # tensors travel by broadcast, the rest pickled
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
                return ("__tensor__", len(tensors) - 1, obj.dtype, tuple(obj.shape), str(obj.device))
            if isinstance(obj, dict):
                return {k: strip(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(strip(v) for v in obj)
            return obj
        skeleton = self.broadcast_object(strip(state) if state is not None else None, root)
        if self._rank != root:
            def alloc(obj: Any) -> Any:
                if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "__tensor__":
                    # on this rank's device, not the root's (cuda:0 on root is cuda:k here)
                    device = self._device if obj[4].startswith("cuda") else torch.device("cpu")
                    t = torch.empty(obj[3], dtype=obj[2], device=device)
                    tensors.append(t)
                    return t
                if isinstance(obj, dict):
                    return {k: alloc(v) for k, v in obj.items()}
                if isinstance(obj, (list, tuple)):
                    return type(obj)(alloc(v) for v in obj)
                return obj
            state = alloc(skeleton)
        for t in tensors:
            self.broadcast_(t, root)
        if self._rank != root:
            inner.load_state_dict(state)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer,
                              named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                              op: ReduceOp | str = ReduceOp.MEAN, compression: str | None = None,
                              backward_passes_per_step: int = 1, bucket_mb: float | None = None,
                              clip_grad_norm: float | None = None) -> Any:
        """unidist's DistributedOptimizer (bucketed, overlapped gradient averaging) around ``optimizer``.

        Args: as ``prepare``; ``named_parameters`` (optional) checks that every optimized parameter is known.
        """
        from unidist.optim.distributed import DistributedOptimizer

        self._need_started()
        return DistributedOptimizer(
            self, optimizer, named_parameters, op=op,
            compression=compression if compression is not None else self.config.compression,
            backward_passes_per_step=backward_passes_per_step,
            bucket_mb=bucket_mb if bucket_mb is not None else self.config.bucket_mb, clip_grad_norm=clip_grad_norm)

    # Options only one engine understands, by name -> the backend that does (refused elsewhere).
    _ENGINE_OPTIONS: ClassVar[Mapping[str, str]] = {"deepspeed_config": "deepspeed"}

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                zero_stage: int | None = None, clip_grad_norm: float | None = None, op: ReduceOp | str = "mean",
                compression: str | None = None, backward_passes_per_step: int = 1, bucket_mb: float | None = None,
                deepspeed_config: Mapping[str, Any] | str | None = None,
                **unknown: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Make ``model`` and ``optimizer`` data parallel; then ``mgr.backward(loss); opt.step();
        opt.zero_grad()`` is the whole loop, the same on every backend.

        The model moves to ``device`` with rank 0's parameters, the optimizer gets rank 0's state, and
        gradients are averaged, so N ranks on B/N rows each train exactly like one process on B rows. The
        returned optimizer is a ``torch.optim.Optimizer`` (LR schedulers, ``param_groups``, ``state_dict``).
        Every argument is checked before anything changes.

        Args:
            model: the user's module. ``mgr.unwrap(returned_model)`` gives it back on every backend.
            optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
            zero_stage: 0-3 (default ``UNIDIST_ZERO_STAGE``); needs the deepspeed backend for now.
            clip_grad_norm: clip the averaged gradient to this global L2 norm, as
                ``torch.nn.utils.clip_grad_norm_`` on one process would; None (default) never clips, on every
                backend (DeepSpeed's own default of 1.0 is switched off).
            op: ``"mean"`` (default) or ``"sum"`` of the ranks' gradients (DeepSpeed only averages).
            compression: ``"none"``, ``"fp16"`` or ``"bf16"`` wire dtype for gradients (default
                ``UNIDIST_COMPRESSION``).
            backward_passes_per_step: k: ``step()``/``zero_grad()`` act on every k-th call and ``backward``
                divides the loss by k, so k passes make one k-times larger batch.
            bucket_mb: gradient fusion bucket size in MiB (default ``UNIDIST_BUCKET_MB``).
            deepspeed_config: a DeepSpeed config (dict or JSON path) merged over the generated one; the
                deepspeed backend only (default ``UNIDIST_DEEPSPEED_CONFIG``).
        """
        self._need_started()
        from unidist.optim.options import TrainOptions

        opts = TrainOptions.parse(
            self.config, zero_stage=zero_stage, clip_grad_norm=clip_grad_norm, op=op, compression=compression,
            backward_passes_per_step=backward_passes_per_step, bucket_mb=bucket_mb,
            deepspeed_config=deepspeed_config, unknown=unknown)
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(f"prepare(model=...) takes a torch.nn.Module, got {type(model).__name__}")
        for name, backend in self._ENGINE_OPTIONS.items():
            if getattr(opts, name) is not None and backend != self.name:
                raise InvalidArgumentError(
                    f"prepare({name}=...) is understood by the {backend} backend only, and this run uses "
                    f"{self.name}; pass it only when mgr.backend == {backend!r}"
                )
        return self._prepare(model, optimizer, opts)

    def _prepare(self, model: torch.nn.Module, optimizer: Any, opts: TrainOptions
                 ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """unidist's DistributedOptimizer; backends with their own training engine override this."""
        if opts.zero_stage:
            raise InvalidArgumentError(
                f"zero_stage={opts.zero_stage} needs the deepspeed backend for now (unidist's own ZeRO for "
                f"{self.name} is not built yet); use zero_stage=0 here or launch with deepspeed"
            )
        wrapped = self.distributed_optimizer(
            optimizer, model.named_parameters(), op=opts.op, compression=opts.compression,
            backward_passes_per_step=opts.backward_passes_per_step, bucket_mb=opts.bucket_mb,
            clip_grad_norm=opts.clip_grad_norm)
        model = model.to(self._device)
        self.broadcast_parameters(model)
        self.broadcast_optimizer_state(optimizer)
        self._prepared = wrapped
        return model, wrapped

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's module behind what ``prepare`` returned (a DeepSpeed engine's ``module``)."""
        return model

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, divided by ``backward_passes_per_step`` so k accumulated passes make one
        k-times larger batch (DeepSpeed's convention)."""
        k = getattr(getattr(self, "_prepared", None), "backward_passes_per_step", 1)
        (loss / k if k > 1 else loss).backward()  # type: ignore[no-untyped-call]

    def shard(self, data: Sized | int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> Any:
        """A sampler giving this rank its disjoint share, reshuffled by ``set_epoch`` (same on every rank)."""
        from unidist.optim.sampler import ShardSampler

        self._need_started()
        return ShardSampler(data, self._rank, self._size, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def mean(self, value: float | torch.Tensor) -> float:
        """The mean of a scalar over ranks, for logging metrics."""
        t = value.detach().reshape(1).to(torch.float64) if isinstance(value, torch.Tensor) else \
            torch.tensor([float(value)], dtype=torch.float64)
        return float(self.allreduce_(t.cpu(), ReduceOp.MEAN).item())

    # ----------------------------------------------------------------- Python objects
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Root's picklable object on every rank (root gets its own object back)."""
        self._check_root(root)
        self._signature("broadcast", root=root)
        if self._rank == root:
            payload = _to_bytes(obj)
            length = torch.tensor([payload.numel()], dtype=_INT64)
        else:
            length = torch.zeros(1, dtype=_INT64)
        self._broadcast(length, root)
        if self._rank != root:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(payload, root)
        return obj if self._rank == root else pickle.loads(payload.numpy().tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, as a list indexed by rank."""
        out, rows = self._allgather_rows("allgather", _to_bytes(obj))
        data, objs, start = out.numpy(), [], 0
        for n in rows:
            objs.append(pickle.loads(data[start:start + n].tobytes()))
            start += n
        return objs


def _rows_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialised tensor with ``rows`` rows shaped like t's rows."""
    return t.new_empty([rows, *t.shape[1:]])


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _check_tag(tag: int) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < 32768:
        raise InvalidArgumentError(f"tag={tag!r} must be an int in 0..32767 (the smallest upper bound MPI allows)")
    return tag


def _bad_dtype(dtype: object) -> InvalidArgumentError:
    names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
    return InvalidArgumentError(f"dtype {dtype} is not supported by unidist collectives; supported: {names}")


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
    return f"{_OBJ_NAMES[call]}({', '.join(parts)})"
