"""The gradient core both of unidist's optimizers are written on (DistributedOptimizer, ZeroOptimizer).

Reducing gradients data-parallel is the same four steps whatever happens to the result (an allreduce into
``p.grad`` for plain data parallelism, a reduce-scatter into a shard for ZeRO):

- **packing**: parameters are grouped into fusion slots (buckets, ZeRO units) in reverse registration order, as
  DDP does, since backward produces the last layers' gradients first (``pack``);
- **the wire copy**: a slot's gradients are copied into one flat buffer, pre-scaled by 1/N for a mean so the
  sum cannot overflow a narrow wire dtype, in the dtype a ``Compressor`` chooses (as Horovod's ``Compression``
  classes: ``Compression.none``, ``.fp16``, ``.bf16``);
- **in-order launch**: a slot starts its collective from the gradient hooks once all its gradients are ready,
  and slots start strictly in order on every rank, so a parameter without a gradient on one rank cannot
  reorder the collectives (``InOrder``);
- **the drain**: ``synchronize`` launches what never became ready (missing gradients count as zeros) and
  waits for every slot in order.

What differs (views into the bucket, shard gradients, stage-3 releases) stays with each optimizer, in its
slot's ``launch`` and ``finish``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, Protocol, TypeVar

import torch

from unidist.errors import InvalidArgumentError

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "InOrder", "NoneCompressor", "Slot",
           "pack"]


class Compressor:
    """How gradients travel: the wire dtype and the (pre-scaled) copy into the wire buffer."""

    name = "none"
    wire: torch.dtype | None = None  # None: the gradients' own dtype

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is reduced in."""
        return self.wire if self.wire is not None else dtype

    def copies(self, dtype: torch.dtype) -> bool:
        """Whether gradients of ``dtype`` need a separate wire buffer (else they can be reduced in place)."""
        return self.wire_dtype(dtype) != dtype

    @staticmethod
    def write(flat: torch.Tensor, grads: Sequence[torch.Tensor | None], numels: Sequence[int], scale: float,
              zero_missing: bool = True) -> None:
        """The wire copy: each gradient, times ``scale``, into its place in ``flat`` (in flat's dtype).

        Scaling happens before the narrowing cast, so a mean's sum of N pre-divided values cannot overflow
        fp16 where the undivided sum would. A missing gradient is zeros (``zero_missing=False`` when ``flat``
        is freshly zeroed)."""
        offset = 0
        with torch.no_grad():
            for g, n in zip(grads, numels, strict=True):
                piece = flat[offset:offset + n]
                if g is None:
                    if zero_missing:
                        piece.zero_()
                else:
                    piece.copy_(g.reshape(-1).mul(scale) if scale != 1.0 else g.reshape(-1))
                offset += n


    @staticmethod
    def write_rows(rows: torch.Tensor, chunk: int, grads: Sequence[torch.Tensor | None], numels: Sequence[int],
                   scale: float) -> None:
        """As :meth:`write`, into the first ``chunk`` columns of each row of ``rows`` (N rows of ``chunk`` + k
        columns): the flat order runs on from one row's first ``chunk`` columns to the next row's, past the k after
        them (a reduce-scatter's chunk r is row r; ZeRO sends each rank the used-flags of its unit in those k).
        Missing gradients are left as they are (``rows`` is freshly zeroed)."""
        offset = 0
        with torch.no_grad():
            for g, n in zip(grads, numels, strict=True):
                if g is not None:
                    src = g.reshape(-1)
                    done = 0
                    while done < n:
                        row, col = divmod(offset + done, chunk)
                        take = min(n - done, chunk - col)
                        piece = src[done:done + take]
                        rows[row, col:col + take].copy_(piece.mul(scale) if scale != 1.0 else piece)
                        done += take
                offset += n


class NoneCompressor(Compressor):
    """Gradients travel in their own dtype."""


class FP16Compressor(Compressor):
    """Gradients travel as float16 (half the bytes; pre-scaled so the sum stays in range)."""

    name, wire = "fp16", torch.float16


class BF16Compressor(Compressor):
    """Gradients travel as bfloat16 (float32's range, 8 bits of mantissa)."""

    name, wire = "bf16", torch.bfloat16


class Compression:
    """The compressors by name, as ``horovod.torch.Compression``: ``Compression.fp16`` and so on."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()

    @classmethod
    def of(cls, name: str) -> Compressor:
        """The compressor called ``name`` ('none', 'fp16', 'bf16')."""
        found = {"none": cls.none, "fp16": cls.fp16, "bf16": cls.bf16}.get(name)
        if found is None:
            raise InvalidArgumentError(f"compression={name!r}; use one of none, fp16, bf16")
        return found


P = TypeVar("P", bound=torch.Tensor)


def pack(params: Sequence[P], limit_bytes: float, key: Callable[[P], Hashable], alone_from: float = math.inf
         ) -> list[list[P]]:
    """Fusion slots: ``params`` in reverse order, a new slot when the next would pass ``limit_bytes`` or has
    another ``key`` (dtype, device, param group: what one flat buffer cannot mix). A parameter of
    ``alone_from`` bytes or more is a slot of its own (reduced where it is, not copied into a shared buffer)."""
    slots: list[list[P]] = []
    current: list[P] = []
    size = 0.0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if nbytes >= alone_from:
            if current:
                slots.append(current)
                current, size = [], 0.0
            slots.append([p])
            continue
        if current and (size + nbytes > limit_bytes or key(current[0]) != key(p)):
            slots.append(current)
            current, size = [], 0.0
        current.append(p)
        size += nbytes
    if current:
        slots.append(current)
    return slots


class Slot(Protocol):
    """One fusion slot: its parameters, which of them have their gradient, and its collective."""

    params: list[torch.nn.Parameter]
    ready: set[int]

    def finish(self) -> None:
        """Wait for the slot's collective (if it was launched) and deliver its result."""


S = TypeVar("S", bound=Slot)


class InOrder(Generic[S]):
    """Slots launched strictly in order on every rank, from the gradient hooks, and drained in order.

    ``launch`` is the optimizer's: it starts one slot's collective (its wire copy and async call).

    The first order (reverse registration) is a guess at the order backward makes gradients. Where it is wrong
    (a tied embedding registered first whose gradient is complete only at the very end; a head registered after
    the layers it follows) one late slot holds back every slot after it: nothing overlaps backward, and ZeRO-3
    keeps every such unit whole until the end. So, as DDP rebuilds its buckets after the first iteration, the
    order in which the first backward completed the slots is recorded and, at the end of the first drain, rank 0's
    is adopted by every rank (``agree``: one broadcast, once); slots that never completed keep their places after.
    """

    def __init__(self, launch: Callable[[S], None], agree: Callable[[list[int]], list[int]] | None = None) -> None:
        self.slots: list[S] = []
        self._of: dict[int, S] = {}
        self._launch = launch
        self._next = 0  # the next slot to launch
        self._agree = agree  # rank 0's completion order, on every rank (None: keep the first order)
        # slot indices in the order the first pass completed them (None: not learning)
        self._seen: list[int] | None = [] if agree is not None else None

    def add(self, slot: S) -> None:
        self.slots.append(slot)
        self._of.update({id(p): slot for p in slot.params})

    def slot_of(self, p: torch.Tensor) -> S | None:
        return self._of.get(id(p))

    def ready(self, p: torch.Tensor) -> S:
        """Mark ``p``'s gradient ready; returns its slot."""
        slot = self._of[id(p)]
        slot.ready.add(id(p))
        seen = self._seen
        if seen is not None and len(slot.ready) == len(slot.params):
            index = next(i for i, s in enumerate(self.slots) if s is slot)
            if index not in seen:
                seen.append(index)
        return slot

    def launch_ready(self) -> None:
        """Launch, in order, every slot from the next one on whose gradients are all ready."""
        while self._next < len(self.slots) and len(self.slots[self._next].ready) == \
                len(self.slots[self._next].params):
            self._launch(self.slots[self._next])
            self._next += 1

    def reset(self) -> None:
        """Forget a step in progress (nothing launched, nothing ready): the owner drops its slots' collectives."""
        self._next = 0
        for slot in self.slots:
            slot.ready.clear()

    def drain(self) -> None:
        """Launch the slots not launched yet (missing gradients count as zeros), then finish all in order."""
        while self._next < len(self.slots):
            self._launch(self.slots[self._next])
            self._next += 1
        for slot in self.slots:
            slot.finish()
            slot.ready.clear()
        self._next = 0
        if self._seen is not None and self._agree is not None:
            order = self._agree(self._seen)
            self._seen = None
            first = [self.slots[i] for i in order]
            self.slots[:] = first + [s for i, s in enumerate(self.slots) if i not in set(order)]
