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

from unidist.comm import buffers
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.train.options import check_bucket_mb, check_clip, check_compression, check_passes, check_sync_op
from unidist.train.window import WindowedOptimizer

if TYPE_CHECKING:
    from unidist.comm.work import Handle
    from unidist.train.protocol import Comm

__all__ = ["DistributedOptimizer"]

_WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Bucket:
    """Parameters whose gradients are reduced in one call. Without compression the gradients *are* the bucket:
    each ``p.grad`` is a view into ``buffer`` (DDP's ``gradient_as_bucket_view``), so nothing is copied in or out;
    a gradient autograd made anew (after ``zero_grad()``, which sets gradients to None as torch does) is copied
    in once and replaced by its view; ``zero_grad(set_to_none=False)`` zeroes the views in place and then no copy
    is made at all. With a narrower wire dtype the buffer is a separate, compressed copy."""

    __slots__ = ("buffer", "handle", "index", "offsets", "params", "ready", "views", "wire")

    def __init__(self, index: int, params: list[torch.nn.Parameter], wire: torch.dtype | None) -> None:
        self.index = index
        self.params = params
        first = params[0]
        self.views = wire is None or wire == first.dtype
        self.wire = None if self.views else wire
        self.buffer = buffers.zeros(sum(p.numel() for p in params), self.wire or first.dtype, first.device)
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
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


class DistributedOptimizer(WindowedOptimizer):
    """Wraps any torch optimizer; see the module docstring for the protocol."""

    def __init__(self, comm: Comm, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                 op: ReduceOp | str = ReduceOp.MEAN, compression: str = "none", backward_passes_per_step: int = 1,
                 bucket_mb: float = 25.0, clip_grad_norm: float | None = None) -> None:
        where = "DistributedOptimizer"
        rop = check_sync_op(op, where)
        check_compression(compression, where)
        check_passes(backward_passes_per_step, where)
        self._bucket_bytes = check_bucket_mb(bucket_mb, where) * 2**20
        self.clip_grad_norm = check_clip(clip_grad_norm, where)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"{where} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is not None:
            known = {id(p) for _, p in named_parameters}
            missing = [p for p in params if id(p) not in known]
            if missing:
                raise InvalidArgumentError(f"{len(missing)} optimizer parameters are not in named_parameters")
        super().__init__(optimizer)
        self.dp = comm  # the ranks gradients are averaged over (the world or a data-parallel Group)
        self.op, self.compression, self.backward_passes_per_step = rop, compression, backward_passes_per_step
        self._buckets: list[_Bucket] = []
        self._where: dict[int, _Bucket] = {}
        self._hooks: list[Any] = []
        self._next = 0  # buckets launch in this order on every rank
        self._calls = 0  # step() calls: the pass index within the accumulation window
        self._no_sync = False
        self._synced = False  # synchronize() already ran for this step
        self._track(params)

    def _track(self, params: list[torch.nn.Parameter]) -> None:
        """Bucket ``params`` (new buckets after the existing ones) and hook their gradients."""
        for bucket in self._make_buckets(params, self._bucket_bytes, _WIRE[self.compression]):
            bucket.index = len(self._buckets)
            self._buckets.append(bucket)
            self._where.update({id(p): bucket for p in bucket.params})
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                        for p in params]

    def _added_param_group(self, group: dict[str, Any]) -> None:
        self._track([p for p in group["params"] if p.requires_grad and id(p) not in self._where])

    @staticmethod
    def _make_buckets(params: list[torch.nn.Parameter], limit: float, wire: torch.dtype | None) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0.0
        for p in reversed(params):
            key = (p.dtype, p.device)
            if current and (size + p.numel() * p.element_size() > limit or (current[0].dtype, current[0].device)
                            != key):
                buckets.append(_Bucket(len(buckets), current, wire))
                current, size = [], 0.0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(len(buckets), current, wire))
        return buckets

    # ------------------------------------------------------------------ sync
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync_pass or self.dp.size == 1:
            return
        bucket = self._where[id(p)]
        bucket.ready.add(id(p))
        while self._next < len(self._buckets) and len(self._buckets[self._next].ready) == \
                len(self._buckets[self._next].params):
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        scale = 1.0 / self.dp.size if self.op is ReduceOp.MEAN else 1.0
        if bucket.views:
            with torch.no_grad():
                bucket.adopt()
                if scale != 1.0:  # divided before the sum, as the copying path does: the same rounding
                    bucket.buffer.mul_(scale)
            bucket.handle = self.dp.allreduce_async_(bucket.buffer, ReduceOp.SUM)
            return
        offset = 0
        with torch.no_grad():
            for p in bucket.params:
                n = p.numel()
                piece = bucket.buffer[offset:offset + n]
                if p.grad is None:
                    piece.zero_()
                else:  # pre-scale before a narrow wire dtype so the sum cannot overflow it
                    piece.copy_(p.grad.reshape(-1).mul(scale) if scale != 1.0 else p.grad.reshape(-1))
                offset += n
        bucket.handle = self.dp.allreduce_async_(bucket.buffer, ReduceOp.SUM)

    def synchronize(self) -> None:
        """Finish every bucket's allreduce (launching those whose gradients never all arrived) and write the
        averaged gradients into ``p.grad``. The next ``step()`` uses them as they are."""
        self._synced = True
        if self.dp.size == 1:
            return
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        with torch.no_grad():
            for bucket in self._buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()
                if bucket.views:  # the gradients were reduced in place
                    bucket.ready.clear()
                    bucket.handle = None
                    continue
                offset = 0
                for p in bucket.params:
                    n = p.numel()
                    avg = bucket.buffer[offset:offset + n].view(p.shape)
                    if p.grad is None:
                        p.grad = avg.to(p.dtype).clone()
                    else:
                        p.grad.copy_(avg)
                    offset += n
                bucket.ready.clear()
                bucket.handle = None
        self._next = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; step()/zero_grad() inside do nothing."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # ------------------------------------------------------------------ optimizer protocol (window.py)
    def _clip(self, max_norm: float) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, buckets={len(self._buckets)}, "
                f"op={self.op.value}, compression={self.compression}, k={self.backward_passes_per_step})")
