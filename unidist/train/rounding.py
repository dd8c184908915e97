"""Rounding noise, injected on purpose: how far rounding alone moves a script (``unidist verify``'s envelope).

One process and N ranks compute the same function with other roundings: each rank sums its gradient over its own
rows (in bfloat16 under bf16 autocast), the ranks' gradients are averaged, a loss is a mean in another order.
How much that moves *this* script's training — a key bias whose gradient is zero but for rounding, an Adam that
turns such noise into full learning-rate steps, a long run that amplifies last bits — is a property of the script,
not of a precision. ``UNIDIST_FINGERPRINT_PERTURB=seed`` measures it: the one-process run is repeated with every
floating output of every module and every parameter's gradient moved by one rounding error, drawn from ``seed``:

- a module output ``t`` becomes ``t + t * eps * r`` (``eps`` its dtype's machine epsilon, ``r`` uniform in [-1, 1]):
  the last bit moves, so the sums that cancel downstream (the key bias's gradient) cancel into new noise, as
  another summation order's would;
- a parameter's gradient moves by the epsilon of the precision it was computed in (bfloat16's under bf16 autocast:
  the gradient of a weight cast to bfloat16 is a bfloat16 sum, every value a bfloat16 one; float32's otherwise)
  times the size of what it sums, which the gradient alone does not tell: its own size, plus the root mean square
  of the whole tensor's gradient for every element that is not exactly zero. That is the rounding a rank's partial
  sum carries into the average: relative to the terms, not to the result, so an element whose terms cancel to
  nearly zero can change sign (under Adam a full learning-rate step: one BERT pooler weight in 1024 did so between
  one process and two ranks in bf16), while a gradient that is exactly zero (an embedding row no token used) stays
  so, as it does on every rank.

Its own generator per device, so the script's random numbers (data order, dropout) are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from unidist.tree import map_tensors

__all__ = ["Rounding", "gradient_epsilon"]


def gradient_epsilon(grad: torch.Tensor) -> float:
    """The machine epsilon of the precision ``grad`` was computed in: its dtype's, or for a float32 gradient whose
    every value is a bfloat16 (float16) one, bfloat16's (float16's)."""
    if grad.dtype == torch.float32 and grad.numel():
        bits = grad.detach().view(torch.int32)
        if not bool((bits & 0xFFFF).any()):
            return torch.finfo(torch.bfloat16).eps
        finite = grad.detach().abs()
        if bool((finite <= torch.finfo(torch.float16).max).all()) and bool(
                (grad.detach().half().float() == grad.detach()).all()):
            return torch.finfo(torch.float16).eps
    return torch.finfo(grad.dtype).eps if grad.is_floating_point() else 0.0


class Rounding:
    """Moves ``model``'s module outputs and the gradients of ``params`` by one rounding error each, from ``seed``.

    Args:
        model: the user's module (None: gradients only, as for ``hvd.DistributedOptimizer``).
        params: the parameters whose gradients move (those that require one).
        seed: the draws' seed (verify's perturbed runs use 1, 2, ...).
    """

    def __init__(self, model: torch.nn.Module | None, params: list[torch.Tensor], seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._hooks: list[Any] = []
        if model is not None:
            for module in model.modules():
                self._hooks.append(module.register_forward_hook(self._on_output))
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_hook(self._on_grad))  # type: ignore[no-untyped-call]

    def _uniform(self, like: torch.Tensor) -> torch.Tensor:
        device = like.device
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return torch.rand(like.shape, generator=gen, device=device, dtype=torch.float32).mul_(2).sub_(1)

    def _move(self, t: torch.Tensor, eps: float) -> torch.Tensor:
        if not t.is_floating_point() or not t.numel() or eps == 0.0:
            return t
        wide = t.float() if t.element_size() < 4 else t  # bfloat16 and float16 move in float32, then round
        return (wide + wide * (self._uniform(t).to(wide.dtype) * eps)).to(t.dtype)

    def _on_output(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        return map_tensors(out, lambda t: self._move(t, torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0))

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        eps = gradient_epsilon(grad)
        if not grad.is_floating_point() or not grad.numel() or eps == 0.0:
            return grad
        with torch.no_grad():
            wide = grad.float() if grad.element_size() < 4 else grad
            scale = wide.abs() + wide.square().mean().sqrt() * (wide != 0)
            return (wide + scale * (self._uniform(grad).to(wide.dtype) * eps)).to(grad.dtype)

    def close(self) -> None:
        """Remove every hook."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
