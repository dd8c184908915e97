"""DistributedOptimizer: gradient averaging written once on a communicator's collectives (world or Group).

Gradients are fused into flat buckets (reverse registration order, as DDP, since backward produces the
last layers' gradients first). A post-accumulate-grad hook on every parameter launches a bucket's async
allreduce as soon as all of its gradients are ready, so communication overlaps the rest of backward;
``step()`` waits for the rest. Buckets are launched strictly in order on every rank, so a parameter that
gets no gradient on one rank cannot reorder the collectives: its bucket (and those after it) go at
``step()`` with zeros for the missing gradient.

The loop is the same as with a DeepSpeed engine: call ``step()`` and ``zero_grad()`` after every
backward; with ``backward_passes_per_step=k`` they act on every k-th call and gradients accumulate
locally in between (``Manager.backward`` divides the loss by k, so the update equals one k-times larger
batch).

It is a ``torch.optim.Optimizer`` sharing the wrapped optimizer's ``param_groups`` and ``state`` (see
``view.py``), so LR schedulers and ``state_dict()`` work as with plain torch. ``clip_grad_norm`` clips the
averaged gradient by its global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` on one process would.
``synchronize()`` may be called before ``step()`` (to read or clip the averaged gradients): ``step()`` then
does not reduce again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from unidist.checkpoint.layout import FullLayout
from unidist.comm import buffers, trace_hooks
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.train.gradcore import Compression, Compressor, InOrder, pack
from unidist.train.options import SyncOptions
from unidist.train.protocol import world_ranks
from unidist.train.window import WindowedOptimizer

if TYPE_CHECKING:
    from unidist.comm.work import Handle
    from unidist.train.protocol import Comm

__all__ = ["DistributedOptimizer"]


class _Bucket:
    """Parameters whose gradients are reduced in one call. Without compression the gradients *are* the bucket:
    each ``p.grad`` is a view into ``buffer`` (DDP's ``gradient_as_bucket_view``), so nothing is copied in or out;
    a gradient autograd made anew (after ``zero_grad()``, which sets gradients to None as torch does) is copied
    in once and replaced by its view; ``zero_grad(set_to_none=False)`` zeroes the views in place and then no copy
    is made at all. With a narrower wire dtype the buffer is a separate, compressed copy."""

    __slots__ = ("buffer", "handle", "numels", "offsets", "params", "ready", "views")

    def __init__(self, params: list[torch.nn.Parameter], compressor: Compressor) -> None:
        self.params = params
        first = params[0]
        self.views = not compressor.copies(first.dtype)
        self.numels = [p.numel() for p in params]
        self.buffer = buffers.zeros(sum(self.numels), compressor.wire_dtype(first.dtype), first.device)
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.ready: set[int] = set()
        self.handle: Handle[torch.Tensor] | None = None

    def piece(self, i: int) -> torch.Tensor:
        """Parameter i's part of the buffer, shaped like it. (Never kept: a second reference to a gradient
        makes autograd accumulate out of place, into a new tensor.)"""
        return self.buffer[self.offsets[i]:self.offsets[i + 1]].view(self.params[i].shape)

    def adopt(self) -> None:
        """Make every gradient a view of the buffer: copy in those autograd made anew, zeros for missing ones."""
        base, size = self.buffer.data_ptr(), self.buffer.element_size()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and g.data_ptr() == base + self.offsets[i] * size and g.is_contiguous():
                continue  # already the view
            view = self.piece(i)
            if g is None:
                view.zero_()
            else:
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
        if self.views:  # the gradients were reduced in place
            return
        with torch.no_grad():
            for i, p in enumerate(self.params):
                avg = self.piece(i)
                if p.grad is None:
                    p.grad = avg.to(p.dtype).clone()
                else:
                    p.grad.copy_(avg)


class DistributedOptimizer(WindowedOptimizer):
    """Wraps any torch optimizer; see the module docstring for the protocol. ``options`` are checked by
    their maker (``SyncOptions.parse``, which ``prepare`` and ``distributed_optimizer`` call)."""

    def __init__(self, comm: Comm, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 options: SyncOptions | None = None) -> None:
        options = options if options is not None else SyncOptions()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                                       f"{type(optimizer).__name__}")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is not None:
            known = {id(p) for _, p in named_parameters}
            missing = [p for p in params if id(p) not in known]
            if missing:
                raise InvalidArgumentError(f"{len(missing)} optimizer parameters are not in named_parameters")
        super().__init__(optimizer)
        self.dp = comm  # the ranks gradients are averaged over (the world or a data-parallel Group)
        self.options = options
        self.op, self.compression = options.op, options.compression
        self.backward_passes_per_step, self.clip_grad_norm = options.backward_passes_per_step, options.clip_grad_norm
        self._compressor = Compression.of(options.compression)
        self._order: InOrder[_Bucket] = InOrder(self._launch)
        self._hooks: list[Any] = []
        self._calls = 0  # step() calls: the pass index within the accumulation window
        self._no_sync = False
        self._synced = False  # synchronize() already ran for this step
        self._track(params)

    @property
    def buckets(self) -> list[_Bucket]:
        """The fusion buckets, in launch order (their buffers persist between steps)."""
        return self._order.slots

    def bucket_of(self, p: torch.Tensor) -> _Bucket | None:
        return self._order.slot_of(p)

    def _track(self, params: list[torch.nn.Parameter]) -> None:
        """Bucket ``params`` (new buckets after the existing ones) and hook their gradients."""
        for members in pack(params, self.options.bucket_bytes, lambda p: (p.dtype, p.device)):
            self._order.add(_Bucket(members, self._compressor))
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                        for p in params]

    def _added_param_group(self, group: dict[str, Any]) -> None:
        self._track([p for p in group["params"] if p.requires_grad and self._order.slot_of(p) is None])

    # ------------------------------------------------------------------ sync
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync_pass or self.dp.size == 1:
            return
        self._order.ready(p)
        self._order.launch_ready()

    def _launch(self, bucket: _Bucket) -> None:
        if trace_hooks.active:  # the timeline: launches against backward (off, this bool test is all it costs)
            with trace_hooks.span("bucket launch", bytes=bucket.buffer):
                self._launch_now(bucket)
        else:
            self._launch_now(bucket)

    def _launch_now(self, bucket: _Bucket) -> None:
        scale = 1.0 / self.dp.size if self.op is ReduceOp.MEAN else 1.0
        with torch.no_grad():
            if bucket.views:
                bucket.adopt()
                if scale != 1.0:  # divided before the sum, as the copying path does: the same rounding
                    bucket.buffer.mul_(scale)
            else:
                self._compressor.write(bucket.buffer, [p.grad for p in bucket.params], bucket.numels, scale)
        bucket.handle = self.dp.allreduce_async_(bucket.buffer, ReduceOp.SUM)

    def synchronize(self) -> None:
        """Finish every bucket's allreduce (launching those whose gradients never all arrived) and write the
        averaged gradients into ``p.grad``. The next ``step()`` uses them as they are."""
        self._synced = True
        if self.dp.size == 1:
            return
        self._order.drain()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; step()/zero_grad() inside do nothing."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # ------------------------------------------------------------------ optimizer protocol (window.py)
    def _clip(self, max_norm: float) -> torch.Tensor:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def checkpoint_layout(self, model: torch.nn.Module) -> FullLayout:
        """Every member of the data-parallel communicator holds the whole state: each writes an even slice."""
        return FullLayout(self.dp.rank, self.dp.size, model, self.optimizer, world_ranks(self.dp))

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """(parameters, gradients) this optimizer keeps beyond the model's own: the fusion buffers."""
        return [], [b.buffer for b in self.buckets]

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, buckets={len(self.buckets)}, "
                f"op={self.op.value}, compression={self.compression}, k={self.backward_passes_per_step})")
