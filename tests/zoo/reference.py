"""What one process computes, in plain torch (no unidist): the reference every zoo cell is compared with.

- float32, ``whole_batch``: one process on all ``BATCH`` rows (what N ranks on B/N rows must equal).
- otherwise (bf16-mixed; BatchNorm with each rank's own statistics): one process that runs each rank's rows
  separately — under ``torch.autocast`` for bf16-mixed, its floating outputs then cast to float32 — and averages the
  rows' losses in float32, the buffers left as rank 0's rows made them. That is what DDP computes (under autocast,
  with ``broadcast_buffers``); one autocast backward over the whole batch differs from it by bfloat16 rounding alone.
- bf16-master: the same per-rank rows on a bfloat16 model (floating inputs cast down, outputs up), each rank's
  gradient divided by the ranks and summed in bfloat16 (at 2 ranks the division is exact: the sum N ranks average),
  and the optimizer stepping float32 copies of the bfloat16 weights, written back rounded after each step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zoo.models import Entry, rows

__all__ = ["on", "reference", "to_float32"]


def to_float32(out: Any) -> Any:
    """The floating tensors of a model's output as float32, written without unidist (ModelOutput, tuples, tensors)."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if dataclasses.is_dataclass(out) and isinstance(out, dict):  # a Hugging Face ModelOutput
        return dataclasses.replace(out, **{k: to_float32(v) for k, v in out.items()})
    if isinstance(out, tuple):
        return type(out)(to_float32(v) for v in out)
    return out


class _Autocast(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model, self.device_type = model, device.type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            out = self.model(*args, **kwargs)
        return to_float32(out)


class _Bf16(torch.nn.Module):
    """A bfloat16 model's forward: floating inputs cast down, floating outputs up (what the prepared model does)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def down(x: Any) -> Any:
            return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return to_float32(self.model(*[down(a) for a in args], **{k: down(v) for k, v in kwargs.items()}))


def _master_copies(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.nn.Parameter]]:
    """The optimizer's parameters replaced by float32 copies: (the bfloat16 parameter, its copy) pairs."""
    pairs = []
    for group in opt.param_groups:
        copies = []
        for p in group["params"]:
            copy = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
            pairs.append((p, copy))
            copies.append(copy)
        group["params"] = copies
    return pairs


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _set_buffers(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(values[k])


def on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def reference(entry: Entry, precision: str, size: int, steps: int, device: torch.device | None = None
              ) -> tuple[dict[str, torch.Tensor], str, float]:
    """(the trained state dict, on the CPU; the type name of the model's output; the first step's gradient norm),
    computed on ``device`` (default the CPU), where the distributed run computed."""
    device = device if device is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = entry.build().to(device)
        masters = precision == "bf16-master"
        if masters:
            model = model.to(torch.bfloat16)
        opt = entry.optimizer(model)
        pairs = _master_copies(opt) if masters else []
        run = _Autocast(model, device) if precision == "bf16-mixed" else _Bf16(model) if masters else model
        whole = precision == "32" and entry.whole_batch
        out_type, first_norm = "", 0.0
        for step in range(steps):
            batch = on(entry.batch(step), device)
            if whole:
                loss, out = entry.loss(run, batch, step)
                loss.backward()
            else:
                before, after = _buffers(model), None
                for r in range(size):
                    _set_buffers(model, before)
                    loss, out = entry.loss(run, rows(batch, r, size), step)
                    (loss / size).backward()
                    if r == 0:
                        after = _buffers(model)
                if after is not None:
                    _set_buffers(model, after)
            if step == 0:
                out_type = type(out).__name__
                grads = [(p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1) for p in model.parameters()
                         if p.grad is not None]
                first_norm = float(torch.cat(grads).norm())
            for p, copy in pairs:
                copy.grad = None if p.grad is None else p.grad.float()
            opt.step()
            with torch.no_grad():
                for p, copy in pairs:
                    p.copy_(copy)
            opt.zero_grad()
            model.zero_grad()
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, out_type, first_norm
