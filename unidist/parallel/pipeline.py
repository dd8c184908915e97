"""Pipeline parallelism over any unidist communicator: rank i of the group runs stage i, micro-batches flow
through with send/recv, on every backend.

Schedules (S stages, M micro-batches):
- ``gpipe``: every micro-batch forward, then every one backward; each stage keeps M micro-batches of
  activations alive at the peak.
- ``1f1b`` (PipeDream-flush, as Megatron's non-interleaved schedule): stage i runs min(S - i - 1, M) warm-up
  forwards, then alternates one forward with one backward, then drains; it keeps at most min(S - i, M)
  micro-batches alive. Same arithmetic, same bubble ((S - 1) / (M + S - 1) of the step), less memory.

Each micro-batch's loss is divided by M before its backward, so the gradients are those of the batch's mean
loss (``loss_fn`` must average over its micro-batch, as torch's losses do by default), and training equals the
unsplit model's on the whole batch. An activation is a tensor or a tuple of tensors (Megatron's hidden state and
mask); gradients go back for its floating-point parts. Shapes are sent once per input shape (a small header before
the first activation), then reused. Exchanges between neighbours are ordered (the lower stage sends first), so
blocking send/recv cannot deadlock, whatever the message size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from unidist.comm import trace_hooks
from unidist.comm.dtypes import DTYPE_ID, SUPPORTED_DTYPES
from unidist.comm.protocol import PeerComm
from unidist.errors import InvalidArgumentError

__all__ = ["Pipeline"]

_SCHEDULES = ("gpipe", "1f1b")
_MAX_DIMS = 8
_TAG_HEADER, _TAG_ACT, _TAG_GRAD = 11, 12, 13
_PER_STEP = ("per step",)  # the key of shapes announced at every step's first micro-batch
_MAX_PARTS = 8  # tensors in one activation tuple


def _detached(activation: Any) -> Any:
    """An activation cut from autograd (inference): each part of a tuple."""
    return tuple(t.detach() for t in activation) if isinstance(activation, tuple) else activation.detach()


def _floating(activation: Any) -> list[torch.Tensor]:
    """The parts of an activation that carry gradients: its floating-point tensors, in order."""
    parts = list(activation) if isinstance(activation, tuple) else [activation]
    return [t for t in parts if t.is_floating_point()]


class Pipeline:
    """One stage of a pipeline; every rank of ``group`` builds one, rank i with stage i.

    Args:
        stage_module: this rank's stage (its parameters are this rank's to optimise).
        group: a Manager or Group; its size is the number of stages.
        microbatches: M, the micro-batches each batch is cut into (along dim 0; the batch must divide by M).
        schedule: "gpipe" or "1f1b".
        loss_fn: ``loss_fn(output, target)`` on the last stage, a mean over the micro-batch.
    """

    def __init__(self, stage_module: torch.nn.Module, group: PeerComm, *, microbatches: int, schedule: str = "gpipe",
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        if not isinstance(stage_module, torch.nn.Module):
            raise InvalidArgumentError(f"Pipeline(stage_module=...) takes a torch.nn.Module, got "
                                       f"{type(stage_module).__name__}")
        if not hasattr(group, "send") or not hasattr(group, "size"):
            raise InvalidArgumentError(f"Pipeline(group=...) takes a unidist Manager or Group, got "
                                       f"{type(group).__name__}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise InvalidArgumentError(f"Pipeline(microbatches={microbatches!r}) must be a positive int")
        if schedule not in _SCHEDULES:
            raise InvalidArgumentError(f"Pipeline(schedule={schedule!r}) must be one of {', '.join(_SCHEDULES)}")
        if loss_fn is not None and not callable(loss_fn):
            raise InvalidArgumentError("Pipeline(loss_fn=...) must be callable: loss_fn(output, target)")
        self.stage, self.group, self.microbatches, self.schedule = stage_module, group, microbatches, schedule
        self.loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = loss_fn
        self.stages, self.index = group.size, group.rank
        self.first, self.last = self.index == 0, self.index == self.stages - 1
        self.eval_outputs: Any = None  # the last stage's outputs of the last eval micro-batch (eval_microbatches)
        # key -> (each part's shape and dtype, whether a tuple)
        self._incoming: dict[tuple[Any, ...], tuple[list[tuple[tuple[int, ...], torch.dtype]], bool]] = {}
        self._announced: set[tuple[Any, ...]] = set()
        self._alive = self._peak = 0
        self._busy = self._step_seconds = 0.0

    # ------------------------------------------------------------------ neighbours
    # An activation is a tensor or a tuple of up to _MAX_PARTS tensors (Megatron's (hidden, mask)); its header lists
    # each part's dtype and shape. Gradients travel back for the floating-point parts only, in the same order.
    def _send_header(self, parts: list[torch.Tensor], tuple_: bool) -> None:
        if len(parts) > _MAX_PARTS:
            raise InvalidArgumentError(f"Pipeline: a stage passes at most {_MAX_PARTS} tensors, got {len(parts)}")
        head = torch.zeros(2 + _MAX_PARTS * (2 + _MAX_DIMS), dtype=torch.int64)
        head[0], head[1] = len(parts), int(tuple_)
        for i, t in enumerate(parts):
            if t.dim() > _MAX_DIMS:
                raise InvalidArgumentError(f"Pipeline: activations of up to {_MAX_DIMS} dimensions, got {t.dim()}")
            at = 2 + i * (2 + _MAX_DIMS)
            head[at], head[at + 1] = DTYPE_ID[t.dtype], t.dim()
            head[at + 2:at + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        self.group.send(head, self.index + 1, _TAG_HEADER)

    def _recv_header(self) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], bool]:
        head = torch.empty(2 + _MAX_PARTS * (2 + _MAX_DIMS), dtype=torch.int64)
        self.group.recv(head, self.index - 1, _TAG_HEADER)
        parts = []
        for i in range(int(head[0])):
            at = 2 + i * (2 + _MAX_DIMS)
            dims = int(head[at + 1])
            parts.append((tuple(int(d) for d in head[at + 2:at + 2 + dims]), SUPPORTED_DTYPES[int(head[at])]))
        return parts, bool(head[1])

    def _send_forward(self, out: Any, key: tuple[Any, ...]) -> None:
        if self.last:
            return
        tuple_ = isinstance(out, tuple)
        parts = list(out) if tuple_ else [out]
        if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
            raise InvalidArgumentError(f"Pipeline: stage {self.index} returned a {type(out).__name__}; a stage passes "
                                       "a tensor, or a tuple of tensors, to the next")
        parts = [t.detach().contiguous() for t in parts]
        if key not in self._announced:
            self._send_header(parts, tuple_)
            self._announced.add(key)
        for t in parts:
            with trace_hooks.span("pipeline send", to=self.index + 1, bytes=t):
                self.group.send(t, self.index + 1, _TAG_ACT)

    def _recv_forward(self, key: tuple[Any, ...]) -> Any:
        if key not in self._incoming:
            self._incoming[key] = self._recv_header()
        specs, tuple_ = self._incoming[key]
        parts = []
        for shape, dtype in specs:
            buf = torch.empty(shape, dtype=dtype, device=self.group.device)
            with trace_hooks.span("pipeline recv", source=self.index - 1, bytes=buf):
                self.group.recv(buf, self.index - 1, _TAG_ACT)
            parts.append(buf.requires_grad_(dtype.is_floating_point))
        return tuple(parts) if tuple_ else parts[0]

    def _send_backward(self, grads: list[torch.Tensor | None], like: Any) -> None:
        """The input's gradients (one per floating-point part, zeros where none) to the stage before."""
        if self.first:
            return
        for grad, part in zip(grads, _floating(like), strict=True):
            g = (grad if grad is not None else torch.zeros_like(part)).contiguous()
            with trace_hooks.span("pipeline send", to=self.index - 1, bytes=g):
                self.group.send(g, self.index - 1, _TAG_GRAD)

    def _recv_backward(self, out: Any) -> list[torch.Tensor]:
        grads = []
        for part in _floating(out):
            buf = torch.empty_like(part, memory_format=torch.contiguous_format)
            with trace_hooks.span("pipeline recv", source=self.index + 1, bytes=buf):
                self.group.recv(buf, self.index + 1, _TAG_GRAD)
            grads.append(buf)
        return grads

    # ------------------------------------------------------------------ one micro-batch
    def _input(self, j: int, inputs: list[torch.Tensor], key: tuple[Any, ...]) -> torch.Tensor:
        return inputs[j] if self.first else self._recv_forward(key)

    def _forward(self, inp: torch.Tensor, j: int, targets: list[Any], loss_sum: list[torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        out: torch.Tensor = self.stage(inp)
        if self.last:
            if self.loss_fn is None:
                raise InvalidArgumentError("Pipeline.train_step needs loss_fn (pass Pipeline(..., loss_fn=...))")
            out = self.loss_fn(out, targets[j]) / self.microbatches
            loss_sum.append(out.detach())
        self._busy += time.perf_counter() - start
        self._alive += 1
        self._peak = max(self._peak, self._alive)
        return out

    def _backward(self, inp: Any, out: Any, grads: list[torch.Tensor] | None) -> list[torch.Tensor | None]:
        """Backward of one micro-batch (``grads``: the next stage's, None on the last stage, whose ``out`` is the
        loss); returns the input's gradients, one per floating-point part (empty on the first stage)."""
        start = time.perf_counter()
        if grads is None:
            if out.requires_grad:
                torch.autograd.backward(out)
        else:
            pairs = [(o, g) for o, g in zip(_floating(out), grads, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._busy += time.perf_counter() - start
        self._alive -= 1
        return [] if self.first else [part.grad if part.requires_grad else None for part in _floating(inp)]

    # ------------------------------------------------------------------ schedules
    def train_step(self, x: torch.Tensor, y: Any) -> float:
        """Forward and backward of every micro-batch of (x, y); returns the batch's mean loss on every rank of
        the group. Gradients accumulate into the stage's parameters (step and zero them as usual).

        Args:
            x: the batch's input (read by the first stage; every rank passes it, or a tensor of its shape).
            y: the batch's target (read by the last stage).
        """
        m = self.microbatches
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % m:
            raise InvalidArgumentError(f"Pipeline.train_step: the batch's first dim must divide into "
                                       f"microbatches={m}, got {tuple(getattr(x, 'shape', ()))}")
        inputs = list(x.chunk(m))
        targets = list(y.chunk(m)) if isinstance(y, torch.Tensor) else [y] * m
        return self._train(inputs, targets, (tuple(inputs[0].shape), x.dtype))

    def train_microbatches(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None) -> float:
        """One step over micro-batches already cut (DeepSpeed's ``train_batch``, which draws each from a data
        iterator): returns their mean loss on every rank of the group; gradients accumulate as in ``train_step``.

        Args:
            inputs: the first stage's ``microbatches`` inputs (tensors); other stages pass None.
            targets: the last stage's ``microbatches`` targets; other stages pass None.
        """
        m = self.microbatches
        for name, given, needed in (("inputs", inputs, self.first), ("targets", targets, self.last)):
            if needed and (given is None or len(given) != m):
                raise InvalidArgumentError(f"Pipeline.train_microbatches: stage {self.index} needs {m} {name} "
                                           f"(microbatches={m}), got {None if given is None else len(given)}")
        # the shapes are announced once per step (the micro-batches of one step share a shape, as DeepSpeed's)
        self._announced.discard(_PER_STEP)
        self._incoming.pop(_PER_STEP, None)
        return self._train(list(inputs or [None] * m), list(targets or [None] * m), _PER_STEP)

    @torch.no_grad()
    def eval_microbatches(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None,
                          count: int | None = None) -> float:
        """The mean loss of the micro-batches without gradients (DeepSpeed's ``eval_batch``), on every rank.

        Args:
            inputs: the first stage's inputs (other stages pass None), as ``train_microbatches``'s.
            targets: the last stage's targets (other stages pass None).
            count: how many micro-batches (default ``microbatches``); every stage passes the same.

        The last stage keeps the last micro-batch's outputs in ``eval_outputs`` (None on the other stages), as
        DeepSpeed's ``eval_batch(return_logits=True)`` returns them.
        """
        m = count if count is not None else self.microbatches
        self.eval_outputs = None
        self._announced.discard(_PER_STEP)
        self._incoming.pop(_PER_STEP, None)
        total = torch.zeros(1)
        for j in range(m):
            inp = inputs[j] if self.first and inputs is not None else _detached(self._recv_forward(_PER_STEP))
            out = self.stage(inp)
            self._send_forward(out, _PER_STEP)
            if self.last:
                if self.loss_fn is None:
                    raise InvalidArgumentError("Pipeline.eval_microbatches needs loss_fn")
                label: Any = None if targets is None else targets[j]
                total += self.loss_fn(out, label).detach().float().reshape(1)
                self.eval_outputs = out
        return float(self.group.broadcast(total / m if self.last else total, root=self.stages - 1)[0])

    def _train(self, inputs: list[Any], targets: list[Any], key: tuple[Any, ...]) -> float:
        loss_sum: list[torch.Tensor] = []
        self._alive = self._peak = 0
        self._busy = 0.0
        start = time.perf_counter()
        if self.schedule == "gpipe":
            self._gpipe(inputs, targets, key, loss_sum)
        else:
            self._one_f_one_b(inputs, targets, key, loss_sum)
        self._step_seconds = time.perf_counter() - start
        total = torch.stack(loss_sum).sum().reshape(1).float() if self.last else torch.zeros(1)
        return float(self.group.broadcast(total, root=self.stages - 1)[0])

    def _gpipe(self, inputs: list[torch.Tensor], targets: list[Any], key: tuple[Any, ...],
               loss_sum: list[torch.Tensor]) -> None:
        kept = []
        for j in range(self.microbatches):
            inp = self._input(j, inputs, key)
            out = self._forward(inp, j, targets, loss_sum)
            self._send_forward(out, key)
            kept.append((inp, out))
        for inp, out in reversed(kept):
            grad = None if self.last else self._recv_backward(out)
            self._send_backward(self._backward(inp, out, grad), inp)

    def _one_f_one_b(self, inputs: list[torch.Tensor], targets: list[Any], key: tuple[Any, ...],
                     loss_sum: list[torch.Tensor]) -> None:
        m = self.microbatches
        warmup = min(self.stages - self.index - 1, m)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j in range(warmup):
            inp = self._input(j, inputs, key)
            out = self._forward(inp, j, targets, loss_sum)
            self._send_forward(out, key)
            kept.append((inp, out))
        steady = m - warmup
        if steady:
            inp = self._input(warmup, inputs, key)
        for k in range(steady):
            j = warmup + k
            out = self._forward(inp, j, targets, loss_sum)
            kept.append((inp, out))
            # with the next stage: this (lower) stage sends its activation, then receives a gradient
            self._send_forward(out, key)
            old_inp, old_out = kept.pop(0)
            grad = None if self.last else self._recv_backward(old_out)
            in_grad = self._backward(old_inp, old_out, grad)
            # with the previous stage: this (upper) stage receives the next activation first, then sends
            if k < steady - 1:
                inp = self._input(j + 1, inputs, key)
            self._send_backward(in_grad, old_inp)
        for old_inp, old_out in kept:
            grad = None if self.last else self._recv_backward(old_out)
            self._send_backward(self._backward(old_inp, old_out, grad), old_inp)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference: the last stage's output for x (micro-batch by micro-batch), returned on every rank."""
        m = self.microbatches if x.shape[0] % self.microbatches == 0 else 1
        key = (tuple(x.chunk(m)[0].shape), x.dtype, "inference")
        outs = []
        for part in x.chunk(m):
            inp = part if self.first else _detached(self._recv_forward(key))
            out = self.stage(inp)
            self._send_forward(out, key)
            outs.append(out)
        full = torch.cat(outs) if self.last else None
        return self.group.broadcast_object(full, root=self.stages - 1)  # type: ignore[no-any-return]

    __call__ = forward

    def memory_stats(self) -> dict[str, Any]:
        """The last train_step: the most micro-batches of activations this stage held at once, and the share
        of the step this stage spent computing (1 - busy/step is its idle share: the bubble and the waits)."""
        return {"schedule": self.schedule, "stages": self.stages, "stage": self.index,
                "microbatches": self.microbatches, "peak_activations": self._peak,
                "busy_seconds": self._busy, "step_seconds": self._step_seconds}
