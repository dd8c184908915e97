"""GradientReducer: gradients averaged in fusion buckets launched from backward's hooks, over any communicator.

What ``DistributedOptimizer`` reduces with, and what a DeepSpeed engine at ZeRO stage 0 can reduce with in place
of its own (engines/deepspeed/trainer.py): the buckets, the hooks and the drain, without the optimizer protocol
around them.
The caller says which backward passes reduce (``sync_pass``: the last of an accumulation window).

How a bucket is reduced depends on what the engine costs, not on a setting (``Communicator.overlaps`` and
``reduce_alone_from``, from the engine's class):

- a gradient of ``reduce_alone_from`` bytes or more is reduced in its own storage, in its own call: nothing is
  copied (on MPI's shared memory a call costs microseconds, and copying a large gradient into a bucket and back
  costs a pass over memory that the fused call does not win back; measured in ``benchmarks/RESULTS.md``);
- smaller gradients are views into one flat buffer per bucket (DDP's ``gradient_as_bucket_view``);
- where collectives move while the process computes (gloo, Horovod) a bucket starts as soon as its gradients are
  ready, overlapping the rest of backward; where they move only inside a wait (MPI) starting early overlaps
  nothing and puts several collectives in flight at once, which MPICH runs at half the speed: the buckets are
  reduced one after another when backward is over.

Buckets start strictly in order on every rank, so a parameter that gets no gradient on one rank cannot reorder
the collectives (``gradcore.InOrder``). A parameter that gets no gradient on *any* rank ends the reduction with
none (``p.grad is None``), as in one process, so the optimizer skips it (no weight decay, no momentum): each rank's
used-flags travel after the last bucket's gradients, in the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from unidist.comm import buffers, trace_hooks
from unidist.ops import ReduceOp
from unidist.train.gradcore import Compressor, InOrder, pack

if TYPE_CHECKING:
    from unidist.comm.protocol import Comm
    from unidist.comm.work import Handle

__all__ = ["GradientReducer"]


class _Bucket:
    """Parameters whose gradients are reduced in one call. Without compression the gradients *are* the bucket:
    each ``p.grad`` is a view into ``buffer`` (DDP's ``gradient_as_bucket_view``), so nothing is copied in or out;
    a gradient autograd made anew (after ``zero_grad()``, which sets gradients to None as torch does) is copied
    in once and replaced by its view; ``zero_grad(set_to_none=False)`` zeroes the views in place and then no copy
    is made at all. With a narrower wire dtype the buffer is a separate, compressed copy."""

    __slots__ = ("buffer", "extra", "handle", "index", "inplace", "numels", "offsets", "params", "ready", "views")

    def __init__(self, params: list[torch.nn.Parameter], compressor: Compressor, inplace: bool = False) -> None:
        self.params = params
        first = params[0]
        # one large parameter reduced in its own gradient's storage: nothing copied, no buffer kept
        self.inplace = inplace and len(params) == 1 and not compressor.copies(first.dtype)
        self.views = not compressor.copies(first.dtype) and not self.inplace
        self.numels = [p.numel() for p in params]
        self.extra = 0  # elements after the gradients: the used-flags of every parameter, in the last bucket
        self.buffer = first.new_empty(0) if self.inplace else \
            buffers.zeros(sum(self.numels), compressor.wire_dtype(first.dtype), first.device)
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.ready: set[int] = set()
        self.handle: Handle[torch.Tensor] | None = None
        self.index = {id(p): i for i, p in enumerate(params)}

    def resize(self, extra: int) -> None:
        """Room for ``extra`` flags after the gradients (a new buffer: gradients that were views into the old one
        are copied in again at the next launch, as after ``zero_grad``)."""
        if extra != self.extra and not self.inplace:
            self.buffer = buffers.zeros(sum(self.numels) + extra, self.buffer.dtype, self.buffer.device)
            self.extra = extra

    def piece(self, i: int) -> torch.Tensor:
        """Parameter i's part of the buffer, shaped like it. (Never kept: a second reference to a gradient
        makes autograd accumulate out of place, into a new tensor.)"""
        return self.buffer[self.offsets[i]:self.offsets[i + 1]].view(self.params[i].shape)

    def own(self) -> None:
        """An in-place slot's buffer is its parameter's gradient (zeros if it has none; made contiguous)."""
        p = self.params[0]
        g = p.grad
        if g is None:
            g = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif not g.is_contiguous():
            g = p.grad = g.contiguous()
        self.buffer = g

    def adopt(self) -> None:
        """Make every gradient a view of the buffer: copy in those autograd made anew, zeros for missing ones."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                view = self.piece(i)
                view.zero_()
                p.grad = view
            else:
                self.adopt_one(p)

    def adopt_one(self, p: torch.Tensor) -> None:
        """``p``'s gradient into its place in the buffer, if autograd made it anew (the gradient hook calls this as
        each one is ready, so autograd's tensor is freed at once: adopting a whole bucket only at its launch, or at
        the drain where collectives wait for backward to end, held a second copy of those gradients meanwhile)."""
        i = self.index[id(p)]
        g = p.grad
        if g is None or (g.data_ptr() == self.buffer.data_ptr() + self.offsets[i] * self.buffer.element_size()
                         and g.is_contiguous()):
            return  # nothing yet, or already the view
        view = self.piece(i)
        view.copy_(g)
        p.grad = view

    def finish(self) -> None:
        """Wait for the allreduce; a compressed copy is written back into the gradients."""
        if self.handle is not None:
            if trace_hooks.active:  # the timeline: off, this bool test is all it costs
                with trace_hooks.span("bucket wait", bytes=self.buffer):
                    self.handle.wait()
            else:
                self.handle.wait()
            self.handle = None
        if self.inplace:  # reduced in the gradient itself; drop the second reference to it (see piece())
            self.buffer = self.buffer.new_empty(0)
            return
        if self.views:  # the gradients were reduced in place
            return
        with torch.no_grad():
            for i, p in enumerate(self.params):
                avg = self.piece(i)
                if p.grad is None:
                    p.grad = avg.to(p.dtype).clone()
                else:
                    p.grad.copy_(avg)


class GradientReducer:
    """Averages (``op`` MEAN) or sums the gradients of ``params`` over ``comm`` in fusion buckets.

    Args:
        comm: the ranks gradients are combined over (the world or a data-parallel Group).
        params: the parameters whose gradients are reduced (hooks are registered on each).
        op: ReduceOp.MEAN or ReduceOp.SUM.
        compressor: the wire dtype (``gradcore.Compression``).
        bucket_bytes: the most bytes in one bucket.
        sync_pass: called in each gradient hook; False means this backward only accumulates locally.
        divide_by: divide the sum by this instead (default: ``comm``'s size for MEAN, 1 for SUM).
    """

    def __init__(self, comm: Comm, params: Iterable[torch.nn.Parameter], op: ReduceOp, compressor: Compressor,
                 bucket_bytes: float, sync_pass: Callable[[], bool], divide_by: int | None = None) -> None:
        self.dp, self.op, self._compressor, self._bucket_bytes = comm, op, compressor, bucket_bytes
        # the sum is divided by this (MEAN: the communicator's size; SUM: 1; an expert's: the data-parallel size)
        self._divide_by = divide_by if divide_by is not None else (comm.size if op is ReduceOp.MEAN else 1)
        self._sync_pass = sync_pass
        self._order: InOrder[_Bucket] = InOrder(self._launch, lambda seen: list(comm.broadcast_object(seen, 0)))
        self.hooks: list[Any] = []
        self._overlap = comm.overlaps
        self._alone_from = comm.reduce_alone_from
        # which parameters had a gradient on this rank at their bucket's launch; the last bucket carries the flags of
        # all (or, when it is reduced in place, a small allreduce of their own after the drain), and a parameter no
        # rank had a gradient for gets none after the reduction, as in one process (DDP's find_unused_parameters)
        self._params: list[torch.nn.Parameter] = []
        self._index: dict[int, int] = {}
        self._used: list[bool] = []
        self._flags: torch.Tensor | None = None  # the flags' own buffer, when the last bucket cannot carry them
        self._alone: list[torch.nn.Parameter] = []  # one rank, a divisor other than 1: divided at synchronize
        self.track(list(params))

    @property
    def buckets(self) -> list[_Bucket]:
        """The fusion buckets, in launch order (their buffers persist between steps)."""
        return self._order.slots

    def bucket_of(self, p: torch.Tensor) -> _Bucket | None:
        """The bucket ``p``'s gradient travels in (None: not tracked)."""
        return self._order.slot_of(p)

    def track(self, params: list[torch.nn.Parameter]) -> None:
        """Bucket ``params`` (new buckets after the existing ones) and hook their gradients. On one rank there is
        nothing to reduce: no bucket is made (no gradient-sized buffer held) and no hook costs a call per
        gradient (one process's step, measured against plain torch by ``unidist bench step``)."""
        if self.dp.size == 1:  # nothing to exchange; an expert's gradient is still divided (see divide_by)
            self._alone += params if self._divide_by != 1 else []
            return
        for members in pack(params, self._bucket_bytes, lambda p: (p.dtype, p.device), self._alone_from):
            # a slot of one parameter from alone_from bytes up is reduced in place (see _Bucket.inplace)
            self._order.add(_Bucket(members, self._compressor, inplace=len(members) == 1 and
                                    members[0].numel() * members[0].element_size() >= self._alone_from))
        self.hooks += [p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                       for p in params]
        for p in params:
            self._index[id(p)] = len(self._params)
            self._params.append(p)
        self._used = [True] * len(self._params)
        self._plan_flags()

    def _plan_flags(self) -> None:
        """The used-flags ride after the last bucket's gradients (when it launches, every earlier bucket has: their
        flags are final), or in a buffer of their own when that bucket is a gradient reduced in place."""
        n = len(self._params)
        last = self.buckets[-1] if self.buckets else None
        for b in self.buckets:
            b.resize(n if b is last and not b.inplace else 0)
        self._flags = None
        if last is not None and last.inplace:
            self._flags = torch.zeros(n, dtype=torch.float32, device=last.params[0].device)

    def held_buffers(self) -> list[torch.Tensor]:
        """The fusion buffers this reducer keeps beyond the model's gradients."""
        return [b.buffer for b in self.buckets if not b.inplace]

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync_pass():
            return
        bucket = self._order.slot_of(p)
        if bucket is not None and bucket.views:  # each gradient takes its place in its bucket as it is ready
            bucket.adopt_one(p)
        if self._overlap:  # else the buckets wait for backward's end (see the module docstring)
            self._order.ready(p)
            self._order.launch_ready()

    def _launch(self, bucket: _Bucket) -> None:
        if trace_hooks.active:  # the timeline: launches against backward (off, this bool test is all it costs)
            with trace_hooks.span("bucket launch", bytes=bucket.buffer):
                self._launch_now(bucket)
        else:
            self._launch_now(bucket)

    def _launch_now(self, bucket: _Bucket) -> None:
        scale = 1.0 / self._divide_by
        for p in bucket.params:  # before own()/adopt() give missing gradients zeros
            self._used[self._index[id(p)]] = p.grad is not None
        with torch.no_grad():
            if bucket.inplace or bucket.views:
                bucket.own() if bucket.inplace else bucket.adopt()
                if scale != 1.0:  # divided before the sum, as the copying path does: the same rounding
                    bucket.buffer.mul_(scale)
            else:
                self._compressor.write(bucket.buffer, [p.grad for p in bucket.params], bucket.numels, scale)
            if bucket.extra:
                bucket.buffer[-bucket.extra:] = torch.tensor(self._used, dtype=bucket.buffer.dtype)
        if self._overlap:
            bucket.handle = self.dp.allreduce_async_(bucket.buffer, ReduceOp.SUM)
        else:
            self.dp.allreduce_(bucket.buffer, ReduceOp.SUM)

    def synchronize(self) -> None:
        """Finish every bucket's allreduce (launching those whose gradients never all arrived) and leave the
        result in ``p.grad``."""
        if self._alone:
            with torch.no_grad():
                for p in self._alone:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / self._divide_by)
        if self.dp.size == 1 or not self.buckets:
            return
        carrier = self.buckets[-1]
        self._order.drain()
        flags = self._flags
        if flags is not None:
            flags.copy_(torch.tensor(self._used, dtype=flags.dtype))
            self.dp.allreduce_(flags, ReduceOp.SUM)
        else:
            flags = carrier.buffer[-carrier.extra:]
        used = (flags > 0).tolist()  # one CPU read per step
        if not all(used):
            for p, u in zip(self._params, used, strict=True):
                if not u:
                    p.grad = None
        if self.buckets[-1] is not carrier:  # the first drain learned another order (gradcore.InOrder)
            self._plan_flags()

    def remove_hooks(self) -> None:
        """Stop reducing: detach the gradient hooks."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
