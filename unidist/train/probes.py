"""Per-module probes for the first steps of a fingerprinted run: where two runs part (``unidist verify --locate``).

When a launch leaves the one-process run at step s, verify re-runs both up to step s with
``UNIDIST_FINGERPRINT_LOCATE=s``; each of those steps' fingerprint lines then carries, for every module, its
forward output and the gradient its backward hands to its input, and for every parameter the gradient its rank
computed before any reduction. Verify walks them in the order the step ran them (forward, backward, then the
reduction, the clipping and the optimizer step, which the line already has) and names the first that leaves the
rounding envelope.

The ranks' shares are combined by the fingerprint's one sum-allreduce, so each statistic must add up across ranks
to what one process computes:

- a forward output: the sum of its elements, of their squares, and their count; the totals give the mean and the
  mean square, which are one process's whether the tensor holds each rank's own rows or is alike on every rank (a
  position table broadcast over the rows); a 0-dimensional output (a loss computed inside the model: each rank's
  the mean over its own rows) is summed and counted apart, so that the ranks' values average to one process's;
- the gradient a module's backward hands its input: a rank's loss is the mean over its own rows, N times the whole
  batch's share of them, so a *row-wise* gradient (first dimension the forward's rows: the model's first input's
  first dimension, 16 in one process, 8 on each of 2 ranks) has its sum and squares scaled by ``share`` (1/N where
  gradients are averaged); a *replicated* one (any other) adds up across ranks to N times the whole, and only its
  sum (scaled by ``share``) is kept (a replicated input whose first dimension happens to equal the rows, or one
  row per rank, blurs the two);
- a parameter's gradient (every rank holds the whole tensor): two linear statistics, the sum and a fixed random
  projection, scaled by ``share``: the mean of the ranks' gradients, what the reduction should produce (and the
  sum of squares, which does not add up across ranks: verify reads it from the one-process run only, as a scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unidist.tree import map_tensors, tensors

__all__ = ["Probes"]

_PROJECTION_SEED = 7919
_PER_MODULE = 8  # forward: sum, squares, count, 0-d sum, 0-d count; backward: row-wise sum, squares, replicated


class Probes:
    """Records per-module and per-parameter statistics of each step up to ``last``.

    Args:
        model: the user's module.
        named_params: the parameters whose gradients are probed, with their names.
        last: the last step probed.
        share: what each rank's gradient counts for in the combined one (1/N where gradients are averaged).
    """

    def __init__(self, model: torch.nn.Module, named_params: Sequence[tuple[str, torch.Tensor]], last: int,
                 share: float) -> None:
        self.last, self.share = last, share
        self.step = 1  # the step being recorded
        modules = [(name or "(model)", m) for name, m in model.named_modules()]
        self.modules = [name for name, _ in modules]
        self.params = [name for name, p in named_params if p.requires_grad]
        # per module: forward (sum, squares, count, scalars' sum, scalars' count), backward (row-wise sum, row-wise
        # squares, replicated sum); per parameter: sum, projection, squares
        self._stats: torch.Tensor | None = None
        self._grads: torch.Tensor | None = None
        self._projections: dict[int, torch.Tensor] = {}
        self._rows = 0  # the rows of the model's forward running now
        self.forward_order: list[int] = []
        self.backward_order: list[int] = []
        self._orders: tuple[list[int], list[int]] = ([], [])
        self._hooks: list[Any] = [model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        for i, (_, module) in enumerate(modules):
            self._hooks.append(module.register_forward_pre_hook(
                lambda m, a, k, i=i: self._on_input(i, m, a, k), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(lambda m, a, out, i=i: self._on_output(i, m, out)))
        live = [p for _, p in named_params if p.requires_grad]
        for j, p in enumerate(live):
            self._hooks.append(p.register_hook(lambda g, j=j: self._on_grad(j, g)))  # type: ignore[no-untyped-call]

    @property
    def active(self) -> bool:
        return self.step <= self.last

    def _on_model(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        first = next((t for t in tensors((args, kwargs)) if t.dim() > 0), None)
        self._rows = int(first.shape[0]) if first is not None else 0

    def _row_wise(self, t: torch.Tensor) -> bool:
        return t.dim() > 0 and self._rows > 0 and t.shape[0] == self._rows

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._stats is None or self._grads is None:
            self._stats = torch.zeros(len(self.modules), _PER_MODULE, dtype=torch.float64, device=device)
            self._grads = torch.zeros(len(self.params), 3, dtype=torch.float64, device=device)
        return self._stats, self._grads

    def _on_output(self, i: int, module: torch.nn.Module, out: Any) -> None:
        if not (self.active and module.training and torch.is_grad_enabled()):
            return
        floats = [t for t in tensors(out) if t.is_floating_point() and t.numel()]
        if not floats:
            return
        stats, _ = self._tables(floats[0].device)
        for t in floats:
            wide = t.detach().to(stats.device, torch.float64)
            if t.dim() == 0:
                stats[i, 3] += wide
                stats[i, 4] += 1
                continue
            stats[i, 0] += wide.sum()
            stats[i, 1] += (wide * wide).sum()
            stats[i, 2] += wide.numel()
        if i not in self.forward_order:
            self.forward_order.append(i)

    def _on_input(self, i: int, module: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if not (self.active and module.training and torch.is_grad_enabled()):
            return None

        def tap(t: torch.Tensor) -> torch.Tensor:
            if not (t.is_floating_point() and t.requires_grad) or isinstance(t, torch.nn.Parameter):
                return t
            seen = t.view_as(t)  # this module's own use of the input: its gradient is this module's backward's
            row_wise = self._row_wise(t)
            seen.register_hook(lambda g: self._on_input_grad(i, g, row_wise))  # type: ignore[no-untyped-call]
            return seen
        return map_tensors(args, tap), map_tensors(kwargs, tap)

    def _on_input_grad(self, i: int, grad: torch.Tensor, row_wise: bool) -> None:
        stats, _ = self._tables(grad.device)
        wide = grad.detach().to(stats.device, torch.float64)
        if row_wise:
            stats[i, 5] += wide.sum() * self.share
            stats[i, 6] += (wide * wide).sum() * self.share * self.share
        else:
            stats[i, 7] += wide.sum() * self.share
        if i not in self.backward_order:
            self.backward_order.append(i)

    def _on_grad(self, j: int, grad: torch.Tensor) -> None:
        if not self.active:
            return
        _, grads = self._tables(grad.device)
        flat = grad.detach().reshape(-1).to(grads.device, torch.float64)
        w = self._projections.get(j)
        if w is None or w.numel() != flat.numel():
            gen = torch.Generator().manual_seed(_PROJECTION_SEED + flat.numel())
            w = torch.randint(0, 2, (flat.numel(),), generator=gen).to(flat.device, torch.float64).mul_(2).sub_(1)
            self._projections[j] = w
        grads[j, 0] += flat.sum() * self.share
        grads[j, 1] += torch.dot(flat, w) * self.share
        grads[j, 2] += torch.dot(flat, flat) * self.share * self.share

    def take(self, device: torch.device) -> torch.Tensor | None:
        """This step's statistics as one flat float64 vector on ``device`` (None past the last step), and start
        the next step."""
        if not self.active:
            return None
        stats, grads = self._tables(device)
        flat = torch.cat([stats.reshape(-1), grads.reshape(-1)]).to(device)
        self._stats = self._grads = None
        self._orders = (self.forward_order, self.backward_order)
        self.forward_order, self.backward_order = [], []
        self.step += 1
        return flat

    def line(self, flat: Sequence[float]) -> dict[str, Any]:
        """The fingerprint line's ``probes`` entry for the step ``take`` ended, from the ranks' summed vector:
        per module in the order the step ran them, ``[mean, mean square, count, mean of the 0-dimensional
        outputs]`` of its forward output's elements and ``[row-wise sum, row-wise squares, replicated sum]`` of its
        input's gradient; per parameter ``[sum, projection, squares]`` of its gradient."""
        m, w = len(self.modules), _PER_MODULE
        forward, backward = self._orders

        def means(k: int) -> list[float]:
            total, squares, count, scalars, scalar_count = flat[w * k: w * k + 5]
            return [total / count if count else 0.0, squares / count if count else 0.0, count,
                    scalars / scalar_count if scalar_count else 0.0]
        return {
            "forward": {self.modules[k]: means(k) for k in forward},
            "backward": {self.modules[k]: list(flat[w * k + 5: w * k + 8]) for k in backward},
            "grads": {n: list(flat[w * m + 3 * j: w * m + 3 * j + 3]) for j, n in enumerate(self.params)},
        }

    def close(self) -> None:
        """Remove every hook."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
