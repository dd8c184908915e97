"""One ZeRO unit: parameters flattened together, split into N equal chunks, this rank's chunk its shard.

The shard arithmetic (which part of which parameter a rank owns), the stage-3 gather and release of the full
parameters, and the reduce-scatter of the unit's gradients (with each rank's used-flags riding in its chunk) live
here; what happens around units (packing, hooks, the step) is ``ZeroOptimizer``'s (zero.py), and how units map to a
checkpoint is ``ZeroLayout``'s (zero_layout.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from unidist.comm import buffers, trace_hooks
from unidist.ops import ReduceOp
from unidist.train import zero_init
from unidist.train.gradcore import Compressor
from unidist.train.offload import cpu_copy, cpu_empty

if TYPE_CHECKING:
    from unidist.comm.protocol import Comm
    from unidist.comm.work import Handle

__all__ = ["Unit"]


class Unit:
    """Parameters flattened together and split into ``dp.size`` equal chunks; this rank owns one. With ``offloaded``
    the shard (and so its gradient and optimizer state) lives in CPU memory (offload.py); ``device`` stays where
    the parameters and the communication are."""

    def __init__(self, dp: Comm, params: list[torch.nn.Parameter], param_group: int, keep_full: bool,
                 offloaded: bool = False, master: torch.dtype | None = None) -> None:
        """``master``: the shard is a copy in this dtype (precision "bf16-master": the optimizer steps float32
        copies of a bfloat16 model; the parameters get the shard rounded back after each step)."""
        self.dp, self.params, self.param_group = dp, params, param_group
        self.shapes = [p.shape for p in params]  # stage 3 empties the parameters themselves
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self.chunk = -(-self.numel // dp.size)  # ceil: the last rank's chunk is padded with zeros
        self.lo = dp.rank * self.chunk
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        if not keep_full and any(zero_init.is_partitioned(p) for p in params):
            own = self._from_parts()
        else:
            full = buffers.zeros(self.chunk * dp.size, self.dtype, self.device)
            with torch.no_grad():
                torch.cat([p.detach().reshape(-1) for p in params], out=full[: self.numel])
            own = full[self.lo:self.lo + self.chunk]
        self.full: torch.Tensor | None = None
        # a prefetch in flight (stage 3): its handle, its buffer, and the shard's version when it started
        self._pending: tuple[Handle[torch.Tensor], torch.Tensor, int] | None = None
        self.prefetches = 0  # prefetches started (and how many of them were used: ``prefetch_hits``)
        self.prefetch_hits = 0
        self.offloaded = offloaded
        self._cpu_grad: torch.Tensor | None = None  # offload: the pinned buffer the reduced gradient comes down to
        # the shard is its own tensor when offloaded or a master copy (else, at stages 1-2, a view of ``full``)
        self.copied = offloaded or (master is not None and master != self.dtype)
        if self.copied:
            own = own.to(master) if master is not None and master != self.dtype else own
            own = cpu_copy(own) if offloaded else own
        if keep_full:  # stages 1-2: parameters are views into the flat buffer
            self._bind(full)
            self.shard = torch.nn.Parameter(own)
        else:
            self.shard = torch.nn.Parameter(own if self.copied else own.clone())
            self.release()
        # one rank, the shard on the device in the parameters' dtype: nothing to exchange, the shard is the whole unit
        self.alone = dp.size == 1 and not self.copied
        self.ready: set[int] = set()
        self.handle: Handle[torch.Tensor] | None = None
        self.used: torch.Tensor | None = None  # after a reduction: which parameters some rank had a gradient for

    def _from_parts(self) -> torch.Tensor:
        """Stage 3 over parameters built partitioned (zero_init.py): this rank's chunk, filled from each parameter
        made whole in turn (collective: one parameter whole at a time, never the unit)."""
        own = torch.zeros(self.chunk, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                value = zero_init.take(p) if zero_init.is_partitioned(p) else p.detach()
                part = self.owned(i)
                if part is not None:
                    s, e, at = part
                    own[at:at + e - s] = value.reshape(-1)[s:e]
        return own

    # ------------------------------------------------------------------ parameters
    def _bind(self, full: torch.Tensor) -> None:
        self.full = full
        offset = 0
        for p, shape, n in zip(self.params, self.shapes, self.numels, strict=True):
            p.data = full[offset:offset + n].view(shape)
            offset += n

    def gather(self) -> None:
        """Full parameters from every rank's shard (stage 3; a no-op while gathered). Every rank's chunk has
        the same size, so the allgather writes into a buffer of known size (``out=``): no sizes exchanged."""
        if self.full is None:
            if self.alone:  # one rank's shard is the whole unit: the parameters are views of it, nothing to copy
                self._bind(self.shard.detach())
                return
            if self._pending is not None:  # prefetched: wait for it (usually long done) instead of starting one
                handle, full, version = self._pending
                self._pending = None
                with trace_hooks.span("zero prefetch wait"):
                    handle.wait()
                # the shard changed since it started (a checkpoint loaded between a forward and its gather): stale
                if version == zero_init.writes(self.shard):
                    self.prefetch_hits += 1
                    self._bind(full)
                    return
            full = torch.empty(self.chunk * self.dp.size, dtype=self.dtype, device=self.device)
            with trace_hooks.span("zero gather", bytes=full):
                self.dp.allgather(self._sendable(), out=full)
            self._bind(full)

    def prefetch(self) -> None:
        """Start gathering the full parameters without waiting for them (stage 3: the next block's while this one
        computes); the gather that needs them waits. A no-op while gathered, prefetching, or alone."""
        if self.full is not None or self._pending is not None or self.alone:
            return
        full = torch.empty(self.chunk * self.dp.size, dtype=self.dtype, device=self.device)
        with trace_hooks.span("zero prefetch", bytes=full):
            self._pending = (self.dp.allgather_async(self._sendable(), out=full), full,
                             zero_init.writes(self.shard))
        self.prefetches += 1

    def release(self) -> None:
        """Free the full parameters (stage 3): each becomes an empty tensor until the next gather."""
        self.drop_prefetch()
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.full = None

    def drop_prefetch(self) -> None:
        """Finish and discard a prefetch nobody used: every rank started it, so every rank waits for it here."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def write_back(self) -> None:
        """Copy this rank's chunk of the full parameters into its shard (after edits inside a gather)."""
        if self.full is not None and not self.alone:  # alone: the parameters are the shard's own storage
            with torch.no_grad():
                self.shard.copy_(self.full[self.lo:self.lo + self.chunk])

    def refresh(self) -> None:
        """Stages 1-2 after a step: every rank's updated shard into the full parameters."""
        if self.full is not None and not self.alone:  # the shard is a view of ``full``: send a copy (MPI forbids
            # aliased buffers); alone, the shard is ``full``
            with torch.no_grad(), trace_hooks.span("zero refresh", bytes=self.full):
                self.dp.allgather(self._sendable(copy=not self.copied), out=self.full)

    def _sendable(self, copy: bool = False) -> torch.Tensor:
        """The shard on the communication's device: an offloaded shard goes up (non-blocking from pinned memory; the CPU
        changes it again only after the device synchronisation before the next step), else the shard itself."""
        shard = self.shard.detach()
        if self.copied:  # down from the master copy's dtype, up from the host: a new tensor either way
            return shard.to(self.device, self.dtype, non_blocking=True, copy=True)
        return shard.clone() if copy else shard

    # ------------------------------------------------------------------ who owns what (the shard arithmetic)
    def offset(self, i: int) -> int:
        """Where parameter i starts in the unit's flat buffer."""
        return sum(self.numels[:i])

    def owned(self, i: int) -> tuple[int, int, int] | None:
        """This rank's part of parameter i: (start, end) within the parameter and the start's position in the
        shard, or None if this rank's chunk holds none of it."""
        off = self.offset(i)
        s, e = max(off, self.lo), min(off + self.numels[i], self.lo + self.chunk)
        return (s - off, e - off, s - self.lo) if s < e else None

    # ------------------------------------------------------------------ gradients
    def launch(self, scale: float, compressor: Compressor, free_grads: bool) -> None:
        """Start the reduce-scatter of this unit's (local) gradients; missing gradients count as zeros. Each rank's
        chunk carries, after its gradient, one flag per parameter of the unit (1 where this rank has a gradient for
        it), so every rank learns which parameters no rank used (``used``) in the same call."""
        if self.alone:
            self._launch_alone(free_grads)
            return
        k = len(self.params)
        flat = buffers.zeros((self.chunk + k) * self.dp.size, compressor.wire_dtype(self.dtype), self.device)
        rows = flat.view(self.dp.size, self.chunk + k)
        compressor.write_rows(rows, self.chunk, [p.grad for p in self.params], self.numels, scale)
        rows[:, self.chunk:] = torch.tensor([p.grad is not None for p in self.params], dtype=rows.dtype)
        if free_grads:
            for p in self.params:
                p.grad = None
        if trace_hooks.active:  # the timeline (off, this bool test is all it costs)
            with trace_hooks.span("bucket launch", bytes=flat):
                self.handle = self.dp.reduce_scatter_async(flat, ReduceOp.SUM)
        else:
            self.handle = self.dp.reduce_scatter_async(flat, ReduceOp.SUM)

    def _launch_alone(self, free_grads: bool) -> None:
        """One rank: the unit's gradient is its parameters' gradients side by side (zeros for a missing one), and
        which were used is known on the CPU, so the step's check of the flags waits for no device."""
        grads = [p.grad for p in self.params]
        if all(g is not None for g in grads):
            flat = torch.empty(self.chunk, dtype=self.dtype, device=self.device)
        else:
            flat = buffers.zeros(self.chunk, self.dtype, self.device)
        with torch.no_grad():
            offset = 0
            for g, n in zip(grads, self.numels, strict=True):
                if g is not None:  # copy_ reads any strides: no reshape copy of a non-contiguous gradient
                    flat[offset:offset + n].view_as(g).copy_(g)
                offset += n
        if free_grads:
            for p in self.params:
                p.grad = None
        self.shard.grad = flat
        self.used = torch.tensor([g is not None for g in grads])

    def finish(self) -> None:
        """Wait for the reduce-scatter and make its result the shard's gradient."""
        if self.handle is None:
            return
        if trace_hooks.active:
            with trace_hooks.span("bucket wait"):
                got = self.handle.wait()
        else:
            got = self.handle.wait()
        self.handle = None
        grad = got[:self.chunk]
        if self.offloaded:  # down as it arrives; ZeroOptimizer.synchronize waits once for all the copies
            if self._cpu_grad is None:
                self._cpu_grad = cpu_empty(self.chunk, self.shard.dtype, self.device)
            self.shard.grad = self._cpu_grad.copy_(grad, non_blocking=True)
        else:  # the shard's dtype: the parameters' (the wire may differ), or the master copy's
            self.shard.grad = grad if grad.dtype == self.shard.dtype else grad.to(self.shard.dtype)
        self.used = got[self.chunk:] > 0  # per parameter: some rank had a gradient for it

    def unused_parts(self) -> list[tuple[int, int]]:
        """(start, end) in this rank's shard of each parameter no rank had a gradient for in the last reduction:
        one process would not have stepped it (its gradient is None there), so the step must leave it as it was."""
        if self.used is None:
            return []
        parts = []
        for i in (~self.used).nonzero().flatten().tolist():
            own = self.owned(i)
            if own is not None:
                s, e, at = own
                parts.append((at, at + e - s))
        return parts
