"""``deepspeed.pipe.LayerSpec`` and ``TiedLayerSpec``: a pipeline's layers described, built on the stage that holds
them (``module.py``), or turned into DeepSpeed's own under its launcher (``handoff.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from unidist.errors import InvalidArgumentError

__all__ = ["LayerSpec", "TiedLayerSpec"]


class LayerSpec:
    """A layer built only on the stage that holds it: ``LayerSpec(torch.nn.Linear, 4, 8, bias=False)``.

    Args:
        typename: an ``nn.Module`` subclass. module_args, module_kwargs: its constructor's arguments.
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise InvalidArgumentError(f"LayerSpec({typename!r}, ...) takes an nn.Module subclass (DeepSpeed: "
                                       "'LayerSpec only supports torch.nn.Module types')")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """The module, constructed now."""
        return self.typename(*self.module_args, **self.module_kwargs)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A LayerSpec whose module is shared by every layer with the same ``key``, across stages (an embedding
    reused as the output projection).

    Args:
        key: the tie's name. typename, module_args, module_kwargs: as LayerSpec.
        forward_fn: ``forward_fn(module, x)`` run for this layer instead of ``module(x)``.
        tied_weight_attr: the attribute(s) (dotted paths) whose gradients the stages sum (default ``weight``).
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable[..., Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
