"""Random ops while a fingerprinted model trains: which ones, where, how often; dropout switched off on request.

Dropout draws one mask element per activation of each rank's rows. N ranks draw N masks from N generators that
stand in the same state; one process draws one mask, of N times the size, from one: the same correct script
computes something else at every world size. ``unidist verify`` therefore runs every launch with the dropout family
as the identity (``UNIDIST_FINGERPRINT_RANDOM=off``: ``F.dropout`` and its variants, the ``dropout_p`` of
``F.scaled_dot_product_attention`` and of ``nn.MultiheadAttention``), so a script with dropout agrees without an
edit, and says so. Other random draws from the default generator (noise added in a forward, ``rrelu``,
``gumbel_softmax``) cannot be made equal across world sizes and are not changed: they are counted and named, so that
verify can name them when launches disagree. ``count`` counts and changes nothing (``verify --keep-random``).

A ``TorchFunctionMode`` sees each torch call made from Python (it costs a Python call per torch call, so only these
runs have it); forward hooks on the model's modules keep the name of the module running, the *site* of a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch.overrides import TorchFunctionMode

__all__ = ["OUTSIDE", "RandomOps"]

OUTSIDE = "(outside the model)"  # the site of a call made while no module of the model runs

# the dropout family: the function -> (the argument that makes it draw nothing, its position, the value that does)
_TRAINING = ("training", 2, False)
_SWITCHES: dict[Callable[..., Any], tuple[str, int, Any]] = {
    F.dropout: _TRAINING, F.dropout1d: _TRAINING, F.dropout2d: _TRAINING, F.dropout3d: _TRAINING,
    F.alpha_dropout: _TRAINING, F.feature_alpha_dropout: _TRAINING,
    torch.dropout: ("train", 2, False), torch.alpha_dropout: ("train", 2, False),
    torch.feature_dropout: ("train", 2, False), torch.feature_alpha_dropout: ("train", 2, False),
    F.scaled_dot_product_attention: ("dropout_p", 4, 0.0),
    F.multi_head_attention_forward: ("dropout_p", 10, 0.0),
}
# what else draws from a generator: counted when it uses the default one (no generator= given)
_DRAWS: set[Any] = {
    torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like, torch.randperm,
    torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.rrelu, F.rrelu, F.gumbel_softmax,
    torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
    torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
    torch.Tensor.geometric_, torch.Tensor.multinomial,
}
# the draws that only draw while training (their training argument: position, default)
_WHILE_TRAINING = {F.rrelu: (3, False), torch.rrelu: (3, False)}


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, index: int, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _draws(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of a dropout-family function draws random numbers (training on, a nonzero rate)."""
    name, index, _ = _SWITCHES[func]
    if name == "dropout_p":
        return bool(_argument(args, kwargs, name, index, 0.0)) and (
            func is not F.multi_head_attention_forward or bool(_argument(args, kwargs, "training", 13, True)))
    rate = _argument(args, kwargs, "p", 1, 0.5)
    return bool(_argument(args, kwargs, name, index, True)) and bool(rate)


def _switched_off(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    name, index, off = _SWITCHES[func]
    if name in kwargs or len(args) <= index:
        return args, {**kwargs, name: off}
    return (*args[:index], off, *args[index + 1:]), kwargs


class RandomOps(TorchFunctionMode):
    """Counts the random calls made while ``model`` trains, by site and op, and with ``switch_off`` runs the
    dropout family as the identity. ``close()`` ends it.

    Args:
        model: the user's module; its submodules' names are the sites.
        switch_off: run dropout (and attention's dropout) as the identity.
    """

    def __init__(self, model: torch.nn.Module, switch_off: bool) -> None:
        super().__init__()
        self.switch_off = switch_off
        self.counts: dict[str, int] = {}  # "site:op" -> calls since the last take()
        self.switched: set[str] = set()  # the "site:op" keys that were switched off
        self._running: list[str] = []
        self._hooks = []
        for name, module in model.named_modules():
            site = name or type(module).__name__
            self._hooks.append(module.register_forward_pre_hook(lambda _m, _a, site=site: self._running.append(site)))
            self._hooks.append(module.register_forward_hook(lambda _m, _a, _o: self._leave(), always_call=True))
        self._entered = False
        self.__enter__()  # type: ignore[no-untyped-call]
        self._entered = True

    def _leave(self) -> None:
        if self._running:
            self._running.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SWITCHES:
            if _draws(func, args, kwargs):
                key = self._count(func)
                if self.switch_off:
                    self.switched.add(key)
                    args, kwargs = _switched_off(func, args, kwargs)
        elif func in _DRAWS and kwargs.get("generator") is None:
            spec = _WHILE_TRAINING.get(func)
            if spec is None or _argument(args, kwargs, "training", *spec):
                self._count(func)
        return func(*args, **kwargs)

    def _count(self, func: Any) -> str:
        site = self._running[-1] if self._running else OUTSIDE
        key = f"{site}:{getattr(func, '__name__', str(func))}"
        self.counts[key] = self.counts.get(key, 0) + 1
        return key

    def take(self) -> dict[str, int]:
        """The calls counted since the last take (a step's), and start counting anew."""
        counts, self.counts = self.counts, {}
        return counts

    def close(self) -> None:
        """Leave the mode (if it is still the innermost one) and remove the hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._entered:
            self._entered = False
            with contextlib.suppress(Exception):  # a mode the script entered after this one is still on top
                self.__exit__(None, None, None)  # type: ignore[no-untyped-call]
