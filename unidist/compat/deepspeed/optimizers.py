"""TEMPORARY minimal stand-in (the lead's bootstrap); helper CONFIG's optimizers.py replaces it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["build_optimizer"]


def build_optimizer(section: Mapping[str, Any], params: Iterable[Any], *, zero_stage: int,
                    allow_untested: bool) -> torch.optim.Optimizer:
    kind, kw = section["type"], dict(section.get("params", {}))
    if kind.lower() in ("adam", "adamw"):
        kw.pop("torch_adam", None)
        w = kw.pop("adam_w_mode", True) or kind.lower() == "adamw"
        kw.setdefault("weight_decay", 0.0)
        return (torch.optim.AdamW if w else torch.optim.Adam)(params, **kw)
    return getattr(torch.optim, kind)(params, **kw)  # type: ignore[no-any-return]
