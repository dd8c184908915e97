"""MPIManager on mpi4py: buffer (uppercase) calls on numpy views of the tensors, no pickling of tensor data.

mpi4py is imported in ``_start`` only: importing ``mpi4py.MPI`` initialises MPI, and ``import unidist`` must
never do that. MPI has no 16-bit float reductions, so float16/bfloat16 are reduced in float32 (the base
class does that); moving them needs no arithmetic, so they travel as raw 16-bit words.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import accumulate
from typing import Any, ClassVar

import numpy as np
import torch

from unidist.comm.engine import Engine
from unidist.comm.work import DONE, EngineWork, Work
from unidist.engines.mpi import shm as mpi_shm
from unidist.engines.mpi.checks import MessageGuard
from unidist.errors import BackendUnavailableError, LaunchEnvironmentError
from unidist.launch import family
from unidist.managers.base import Manager
from unidist.ops import ReduceOp
from unidist.registry import for_launcher, get

__all__ = ["MPIEngine", "MPIManager"]

_SUM = ReduceOp.SUM


def import_mpi() -> Any:
    """``mpi4py.MPI``, or a BackendUnavailableError that says what to install."""
    if "mpi4py.MPI" not in sys.modules:  # MPI_Init runs at this import: clear what a killed job left first
        mpi_shm.remove_stale()
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise BackendUnavailableError(
            f"the 'mpi' backend needs mpi4py and an MPI library ({err}); {get('mpi').install}") from err
    return MPI


def _request(req: Any, *keep: object) -> Work:
    """A request that keeps every tensor it reads or writes alive until it completes: the buffer specs
    point at raw addresses and would not keep a temporary (an upcast or contiguous copy) from being freed."""
    return EngineWork(req.Wait, req.Test, *keep)


# MPICH's allreduce falls off a cliff above a few MiB on shared memory (measured on 2 ranks: 2.1 GB/s for 32 and
# 128 MiB in one call, 7.1-7.4 GB/s for the same data in 2 MiB pieces; 256 KiB pieces 4.3, 1 MiB 6.2, 4 MiB 6.9):
# larger allreduces are made of 2 MiB ones, one after another. (Allgather has no such cliff: 7.7-9.5 GB/s whole,
# slower in pieces; reduce_scatter's pieces need a copy that costs more than they win.)
CHUNK_BYTES = 2 << 20
CHUNKED_ABOVE = 2 * CHUNK_BYTES


def _chunks(send: torch.Tensor, recv: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Matching ``CHUNK_BYTES`` slices of two contiguous tensors (the same tensor when in place)."""
    step = max(1, CHUNK_BYTES // recv.element_size())
    flat_s, flat_r = send.view(-1), recv.view(-1)
    for start in range(0, flat_r.numel(), step):
        yield flat_s[start:start + step], flat_r[start:start + step]


class _Chain:
    """Nonblocking requests run one after another: the next starts when the previous has ended (``test`` moves
    the chain on; ``wait`` runs it out). Every rank cuts the same pieces, so the requests match."""

    def __init__(self, start: Callable[[int], Any], n: int) -> None:
        self._start, self._n, self._i = start, n, 0
        self._req: Any = start(0)

    def _next(self) -> None:
        self._i += 1
        self._req = self._start(self._i) if self._i < self._n else None

    def test(self) -> bool:
        while self._req is not None and self._req.Test():
            self._next()
        return self._req is None

    def wait(self) -> None:
        while self._req is not None:
            self._req.Wait()
            self._next()


def _even(counts: Sequence[int]) -> bool:
    """Every rank's count the same (the plain call then does what the v-call would, faster)."""
    return all(c == counts[0] for c in counts)


def _displs(counts: Sequence[int]) -> list[int]:
    return [0, *accumulate(counts)][:-1]


class _Shared:
    """What every MPI engine of one run shares: mpi4py's datatype and op tables, and what is freed at close (the
    persistent requests first, then the communicators, newest first)."""

    def __init__(self, MPI: Any) -> None:
        self.MPI = MPI
        self.ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}
        self.types = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.float16: MPI.INT16_T, torch.bfloat16: MPI.INT16_T,  # moved as bits, never reduced here
            torch.int8: MPI.INT8_T, torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T, torch.uint8: MPI.UINT8_T, torch.bool: MPI.UINT8_T,
        }
        self.cuda_aware = query_cuda_support(MPI)
        self.persistent: list[Any] = []
        self.comms: list[Any] = []

    def close(self) -> None:
        for req in self.persistent:
            req.Free()
        self.persistent.clear()
        for comm in reversed(self.comms):
            comm.Free()
        self.comms.clear()


class MPIEngine(Engine):
    """MPI primitives over one communicator ``_comm`` (the world's duplicate, or a group's Split of it) and the
    desync check's duplicate of it, ``_check_comm``. The hot calls read their tables from this instance's own
    attributes (each read through ``_shared`` is ~0.1 us against a 2 us shared-memory allreduce)."""

    # MPI has no 16-bit float reductions: reduce them in float32 (moving them needs no arithmetic)
    upcast_reduce: ClassVar[Mapping[torch.dtype, torch.dtype]] = {
        torch.float16: torch.float32, torch.bfloat16: torch.float32}
    aborts_job = True
    # MPICH moves a nonblocking collective only inside Test/Wait (no progress thread unless MPIR_CVAR_ASYNC_PROGRESS,
    # which costs a core). Measured on 2 ranks, 102 MB of gradients in 5 buckets: started from backward's hooks,
    # several Iallreduce chains in flight at once took 50 ms; the same buckets reduced one after another, 24 ms
    progresses_alone = False
    # a call costs microseconds here: a gradient from 1 MiB up is reduced where it is, without a copy into a bucket
    # (ResNet-50 shapes on 2 ranks, sync / raw per-tensor: 1.65 all copied, 1.21 from 4 MiB, 1.07 from 1 MiB, 1.11
    # from 256 KiB; measured interleaved on a loaded machine, see benchmarks/RESULTS.md for quiet figures)
    reduce_alone_from = float(1 << 20)

    def __init__(self, comm: Any, check_comm: Any, shared: _Shared) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        MPI = shared.MPI
        self._comm, self._check_comm, self._shared = comm, check_comm, shared
        shared.comms += [comm, check_comm]
        self._specs: dict[tuple[Any, ...], list[Any]] = {}
        self._types, self._ops, self._cuda_aware = shared.types, shared.ops, shared.cuda_aware
        self._cuda_present = torch.cuda.is_available()
        self._mpi_sum = MPI.SUM  # the common op without an Enum hash (~0.1 us)
        self._in_place, self._frombuffer = MPI.IN_PLACE, MPI.buffer.fromaddress
        self._empty = np.empty(0, dtype=np.uint8)
        self._check_np = self.check_np
        self._check_req: Any = None
        self._persistent = shared.persistent  # persistent requests, freed before the communicators
        self._guard = MessageGuard(MPI, comm, check_comm)

    def _split(self, lists: list[list[int]]) -> list[Engine | None]:
        """One ``Comm.Split`` for all the (disjoint) lists: color = the list, key = the position in it."""
        mine = next((i for i, ranks in enumerate(lists) if self.rank in ranks), None)
        color = self._shared.MPI.UNDEFINED if mine is None else mine
        key = 0 if mine is None else lists[mine].index(self.rank)
        sub = self._comm.Split(color, key)
        out: list[Engine | None] = [None] * len(lists)
        if mine is not None:
            out[mine] = MPIEngine(sub, sub.Dup(), self._shared)
        return out

    def abort(self, code: int) -> None:
        """MPI_Abort: mpiexec ends every rank of the job."""
        self._shared.MPI.COMM_WORLD.Abort(code)

    def close(self) -> None:
        """Free every communicator and persistent request of this run (called on the world's engine)."""
        self._specs.clear()
        self._shared.close()

    # ------------------------------------------------------------ buffers
    def _spec(self, t: torch.Tensor, counts: Sequence[int] | None = None) -> list[Any]:
        """``[buffer, count(s), datatype]`` over t's memory, no copy.

        A CPU spec depends only on (address, bytes, dtype), so it is cached on that key: building one costs
        ~2 us, more than a small shared-memory Allreduce itself (measured). An address reused by a new
        tensor of the same size and dtype gets an identical, still-correct spec.
        """
        if not t.is_cuda:
            key = (t.data_ptr(), t.nbytes, t.dtype, None if counts is None else tuple(counts))
            spec = self._specs.get(key)
            if spec is None:
                nbytes = t.nbytes
                buf = self._frombuffer(t.data_ptr(), nbytes) if nbytes else self._empty
                spec = self._make_spec(buf, t, counts)
                if len(self._specs) >= 4096:
                    self._specs.clear()
                self._specs[key] = spec
            return spec
        # CUDA-aware MPI reads device memory through __cuda_array_interface__
        return self._make_spec(t.view(torch.int16) if t.dtype is torch.bfloat16 else t, t, counts)

    def _block(self, t: torch.Tensor) -> list[Any]:
        """``[buffer, datatype]``: for the block collectives (Allgather, Alltoall, Reduce_scatter_block) mpi4py
        then splits the buffer evenly over the ranks (an explicit count would be read as a per-rank count)."""
        spec = self._spec(t)
        return [spec[0], spec[-1]]

    def _make_spec(self, buf: Any, t: torch.Tensor, counts: Sequence[int] | None) -> list[Any]:
        if counts is None:
            return [buf, t.numel(), self._types[t.dtype]]
        return [buf, (list(counts), _displs(counts)), self._types[t.dtype]]

    def _staged(self, fn: Callable[..., Any], send: torch.Tensor | None, recv: torch.Tensor | None,
                *args: Any) -> None:
        """Without CUDA-aware MPI, device tensors go through host copies: pinned (the caching host allocator keeps
        them; a copy from pageable memory would be staged twice by the driver), and blocking, so the copy to the
        host waits for the stream that produced ``send`` before MPI reads it, and ``recv`` is whole on the device
        before this returns."""
        host_send = _pinned_copy(send) if send is not None else None
        if recv is None:
            host_recv = None
        elif recv is send:
            host_recv = host_send
        else:
            host_recv = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=recv.is_cuda)
        fn(host_send, host_recv, *args)
        if recv is not None and host_recv is not None:
            recv.copy_(host_recv)

    def _device_ok(self, a: torch.Tensor | None, b: torch.Tensor | None = None) -> bool:
        return (self._cuda_aware or ((a is None or not a.is_cuda) and (b is None or not b.is_cuda)))

    # ------------------------------------------------------------ primitives
    def barrier(self) -> None:
        self._comm.Barrier()

    # The desync check on its own communicator: a check never matches a desynchronised peer's data call, and it
    # may run beside the call it checks. One persistent collective for every check, blocking or not (MPI matches
    # a persistent collective only with persistent ones): its schedule is built once, 1.6 us beside an 8-byte
    # call vs 2.7 us for an Iallreduce each time (measured on 2 ranks).
    def check_exchange(self, *about: object) -> None:
        self.check_exchange_async()()

    def check_exchange_async(self) -> Callable[[], object]:
        req = self._check_req
        if req is None:
            req = self._check_req = self._check_comm.Allreduce_init(self._in_place, self._check_np,
                                                                    self._ops[ReduceOp.MAX])
            self._persistent.append(req)
        req.Start()
        return req.Wait  # type: ignore[no-any-return]

    def check_rows(self, mine: torch.Tensor, table: torch.Tensor) -> Work:
        counts = [mine.numel()] * self.size
        return _request(self._check_comm.Iallgatherv(self._spec(mine), self._spec(table, counts)), mine, table)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        if not self._device_ok(t):
            return self._staged(lambda s, r: self.broadcast(r, root), t, t)
        self._comm.Bcast(self._spec(t), root)

    def broadcast_async(self, t: torch.Tensor, root: int) -> Work:
        if not self._device_ok(t):
            self.broadcast(t, root)
            return DONE
        spec = self._spec(t)
        return _request(self._comm.Ibcast(spec, root), t, spec)

    def allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        # the hottest call: every attribute read here is ~0.1 us against a 2 us shared-memory allreduce
        if recv.is_cuda and not self._cuda_aware:
            return self._staged(self.allreduce, send, recv, op)
        nbytes = recv.nbytes
        mpi_op = self._mpi_sum if op is _SUM else self._ops[op]
        if nbytes > CHUNKED_ABOVE:
            for s, r in _chunks(send, recv):
                self._comm.Allreduce(self._in_place if send is recv else self._spec(s), self._spec(r), mpi_op)
            return
        rspec = self._specs.get((recv.data_ptr(), nbytes, recv.dtype, None)) or self._spec(recv)
        self._comm.Allreduce(self._in_place if send is recv else self._spec(send), rspec, mpi_op)

    def prepared_sum(self, t: torch.Tensor) -> Any:
        # only where no CUDA device exists: a spec is found by address alone, and a host address is then never a
        # device tensor's
        if self._cuda_present or t.nbytes > CHUNKED_ABOVE:
            return None
        return self._spec(t)

    def allreduce_prepared(self, t: torch.Tensor, prepared: Any, op: ReduceOp) -> None:
        self._comm.Allreduce(self._in_place, prepared, self._mpi_sum)

    def prepared_buffer(self, t: torch.Tensor) -> Any:
        return None if self._cuda_present else self._spec(t)  # (as prepared_sum)

    def broadcast_prepared(self, t: torch.Tensor, prepared: Any, root: int) -> None:
        self._comm.Bcast(prepared, root)

    def prepared_blocks(self, send: torch.Tensor, recv: torch.Tensor) -> Any:
        if self._cuda_present:  # (as prepared_sum)
            return None
        return self._block(send), self._block(recv)

    def allgather_prepared(self, send: torch.Tensor, recv: torch.Tensor, prepared: Any) -> None:
        self._comm.Allgather(*prepared)

    def alltoall_prepared(self, send: torch.Tensor, recv: torch.Tensor, prepared: Any) -> None:
        self._comm.Alltoall(*prepared)

    def reduce_scatter_prepared(self, send: torch.Tensor, recv: torch.Tensor, prepared: Any, op: ReduceOp) -> None:
        self._comm.Reduce_scatter_block(prepared[0], prepared[1], self._mpi_sum)

    def allreduce_async(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> Work:
        if not self._device_ok(recv):
            self.allreduce(send, recv, op)
            return DONE
        if recv.nbytes > CHUNKED_ABOVE:
            pieces = list(_chunks(send, recv))

            def start(i: int) -> Any:
                s, r = pieces[i]
                return self._comm.Iallreduce(self._in_place if send is recv else self._spec(s), self._spec(r),
                                             self._ops[op])
            chain = _Chain(start, len(pieces))
            return EngineWork(chain.wait, chain.test, send, recv, pieces)
        sspec = self._in_place if send is recv else self._spec(send)
        rspec = self._spec(recv)
        return _request(self._comm.Iallreduce(sspec, rspec, self._ops[op]), send, recv, sspec, rspec)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        if not self._device_ok(send, recv):
            return self._staged(self.allgather, send, recv, counts)
        if _even(counts):  # MPICH's Allgatherv runs at half Allgather's rate (2 MiB: 284 vs 142 us on 2 ranks)
            self._comm.Allgather(self._block(send), self._block(recv))
            return
        self._comm.Allgatherv(self._spec(send), self._spec(recv, counts))

    def allgather_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Work:
        if not self._device_ok(send, recv):
            self.allgather(send, recv, counts)
            return DONE
        if _even(counts):
            sspec, rspec = self._block(send), self._block(recv)
            return _request(self._comm.Iallgather(sspec, rspec), send, recv, sspec, rspec)
        sspec, rspec = self._spec(send), self._spec(recv, counts)
        return _request(self._comm.Iallgatherv(sspec, rspec), send, recv, sspec, rspec)

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        if not self._device_ok(send, recv):
            return self._staged(self.alltoall, send, recv, send_counts, recv_counts)
        if _even(send_counts) and _even(recv_counts):  # as for Allgather: the v-variant is slower
            self._comm.Alltoall(self._block(send), self._block(recv))
            return
        self._comm.Alltoallv(self._spec(send, send_counts), self._spec(recv, recv_counts))

    def gather(self, send: torch.Tensor, recv: torch.Tensor | None, counts: Sequence[int], root: int) -> None:
        if not self._device_ok(send, recv):
            return self._staged(self.gather, send, recv, counts, root)
        self._comm.Gatherv(self._spec(send), self._spec(recv, counts) if recv is not None else None, root)

    def scatter(self, send: torch.Tensor | None, recv: torch.Tensor, counts: Sequence[int], root: int) -> None:
        if not self._device_ok(send, recv):
            return self._staged(self.scatter, send, recv, counts, root)
        self._comm.Scatterv(self._spec(send, counts) if send is not None else None, self._spec(recv), root)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                        op: ReduceOp) -> None:
        if not self._device_ok(send, recv):
            return self._staged(self.reduce_scatter, send, recv, counts, op)
        if _even(counts):
            self._comm.Reduce_scatter_block(self._block(send), self._block(recv), self._ops[op])
            return
        self._comm.Reduce_scatter(self._spec(send), self._spec(recv), list(counts), self._ops[op])

    def reduce_scatter_async(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int],
                              op: ReduceOp) -> Work:
        if not self._device_ok(send, recv):
            self.reduce_scatter(send, recv, counts, op)
            return DONE
        sspec, rspec = self._spec(send), self._spec(recv)
        return _request(self._comm.Ireduce_scatter(sspec, rspec, list(counts), self._ops[op]), send, recv, sspec,
                        rspec)

    def reduce(self, send: torch.Tensor, recv: torch.Tensor, root: int, op: ReduceOp) -> None:
        if not self._device_ok(send, recv):
            return self._staged(self.reduce, send, recv, root, op)
        self._comm.Reduce(self._spec(send), self._spec(recv), self._ops[op], root)

    def send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        if not self._device_ok(t):
            t = t.cpu()
        self._comm.Send(self._spec(t), dest, tag)

    def recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        if not self._device_ok(t):
            return self._staged(lambda s, r: self.recv(r, source, tag), None, t)
        self._guard.recv(self._spec(t), t, source, tag)  # the status's count against the buffer (checks.py)

    def pending_mismatch(self) -> Exception | None:
        return self._guard.pending()


class MPIManager(Manager):
    """MPI through mpi4py; topology from the engine (shared-memory split gives local rank and node)."""

    name = "mpi"

    @property
    def comm(self) -> Any:
        """The mpi4py communicator unidist's world collectives use (a duplicate of ``COMM_WORLD``), for code
        that calls mpi4py beside unidist without matching unidist's messages."""
        self._need_started()
        return self._comm

    def _start(self) -> Engine:
        MPI = import_mpi()
        comm = MPI.COMM_WORLD.Dup()  # our own context: user MPI traffic cannot match ours
        check_comm = comm.Dup()  # the desync check's own context (see MPIEngine.check_exchange)
        rank, size = comm.Get_rank(), comm.Get_size()
        if self.launch.launched and self.launch.size != size:
            check_comm.Free()
            comm.Free()
            fam = family(self.launch.launcher)
            if fam is not None and not fam.mpi_like:  # torchrun, deepspeed, horovodrun --gloo: no MPI world
                raise LaunchEnvironmentError(
                    f"UNIDIST_BACKEND=mpi, but the {self.launch.launcher} launcher started these "
                    f"{self.launch.size} processes without an MPI world (each one is MPI rank 0 of 1). Use the "
                    f"{for_launcher(fam.name)} backend under {self.launch.launcher} (unset UNIDIST_BACKEND), or "
                    "start the job with mpiexec for the mpi backend.")
            if self.launch.launcher == "slurm":  # the slurm row matches only a step without PMI (launch.py)
                raise LaunchEnvironmentError(
                    f"srun started these {self.launch.size} processes without PMI, so MPI sees each as a world of "
                    f"{size}: the mpi backend needs srun to give MPI the job's processes. Start with `srun "
                    "--mpi=pmi2 ...`, or export SLURM_MPI_TYPE=pmi2 (in an sbatch script, before srun), or ask "
                    "for MpiDefault=pmi2 in slurm.conf (`srun --mpi=list` shows what this Slurm offers). Or use "
                    "UNIDIST_BACKEND=torch, which needs no PMI under srun.")
            raise LaunchEnvironmentError(
                f"the {self.launch.launcher} launcher announced {self.launch.size} processes but MPI sees "
                f"{size}: mpi4py is linked to a different MPI than the launcher that started this job. "
                "Launch with the mpiexec of the MPI mpi4py uses (`unidist launch` picks it) or rebuild mpi4py."
            )
        self._node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        self._local_rank, self._local_size = self._node.Get_rank(), self._node.Get_size()
        leaders = comm.Split(0 if self._local_rank == 0 else MPI.UNDEFINED, rank)
        node_rank = np.array([leaders.Get_rank() if leaders != MPI.COMM_NULL else 0], dtype=np.int64)
        if leaders != MPI.COMM_NULL:
            leaders.Free()
        self._node.Bcast([node_rank, 1, MPI.INT64_T], root=0)
        self._node_rank = int(node_rank[0])
        self._comm = comm  # the world's MPI communicator (the benchmarks' raw-engine calls use it)
        self._mpi = MPIEngine(comm, check_comm, _Shared(MPI))
        return self._mpi

    def _shutdown(self) -> None:
        self._node.Free()
        self._mpi.close()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: a CUDA tensor copied into pinned memory (the copy waits for ``t``'s stream), a host
    tensor as it is."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def query_cuda_support(MPI: Any) -> bool:
    """MPIX_Query_cuda_support (Open MPI, MPICH) from the MPI library mpi4py loaded; False if absent (also what
    ``unidist info --check`` reports)."""
    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    fn.restype = ctypes.c_int
    return bool(fn())
